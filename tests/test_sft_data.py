"""SFT data (`slapo/data/sft.py`): rows, loss only on responses, padded and packed batches.

The packing claim is proven, not assumed: a packed batch (position_ids restarting per
document, no attention_mask) gives each document's per-token losses and the summed gradient
of its documents run one by one, in float64, for tiny LLaMA, Qwen3 and GPT-2; and the same
batch with plain `arange` positions, or with a KV cache, does not (cross-document attention).
Tokenizers with chat templates are built here, offline (`tokenizers` + PreTrainedTokenizerFast,
saved and reloaded through Slapo's `load_tokenizer`).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from slapo.data import IGNORE_INDEX, ByteTokenizer, InputError, load_tokenizer
from slapo.data.sft import (
    pack_documents,
    pad_batch,
    plan_rows,
    read_sft_rows,
    tokenize_row,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# the ChatML-like template most chat models use, and the same one marking what the assistant
# generates with {% generation %} (HF's return_assistant_tokens_mask)
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_GEN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
              "{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}{% else %}"
              "{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# the template's author leaves the end-of-turn mark out of what is learnt: HF's mask is followed
CONTENT_GEN = CHATML_GEN.replace("<|im_end|>{% endgeneration %}", "{% endgeneration %}<|im_end|>")
# shows earlier assistant turns shortened (as templates that drop earlier reasoning do)
REWRITING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and "
             "not loop.last %}...{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONTROL = ["<|im_start|>", "<|im_end|>"]
WORDS = ("system user assistant Be brief . What is two plus two ? four And times three "
         "twelve no").split()
CHAT = [{"role": "system", "content": "Be brief ."},
        {"role": "user", "content": "What is two plus two ?"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "And times three ?"},
        {"role": "assistant", "content": "twelve"}]


def word_tokenizer(out: Path, template: str | None) -> Path:
    """A word-level fast tokenizer (one token per word: labels are easy to read), the ChatML
    control tokens as specials, `template` as its chat template; saved like any HF one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]", *CONTROL, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   eos_token="[EOS]", additional_special_tokens=CONTROL)
    fast.chat_template = template
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    return {name: word_tokenizer(root / name, t) for name, t in
            (("chatml", CHATML), ("generation", CHATML_GEN), ("content_gen", CONTENT_GEN),
                                ("rewriting", REWRITING),
             ("none", None))}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows),
                    encoding="utf-8")
    return path


def labelled(tok, ids: list[int], labels: list[int]) -> list[str]:
    """The tokens that carry a loss, and each label is its own input id."""
    assert all(lab in (IGNORE_INDEX, i) for i, lab in zip(ids, labels))
    return tok.tok.convert_ids_to_tokens([i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX])


# ---- rows and labels ----------------------------------------------------------------------------
def test_prompt_response_bytes_labels_only_the_response_and_eos():
    tok = ByteTokenizer()
    ids, labels = tokenize_row({"prompt": "Q: 2+2?\nA:", "response": " 4"}, tok)
    assert ids == list(b"Q: 2+2?\nA: 4") + [tok.eos_id]
    assert labels == [IGNORE_INDEX] * 10 + [ord(" "), ord("4"), tok.eos_id]


def test_prompt_response_hf_tokenizer(tok_dirs):
    tok = load_tokenizer(str(tok_dirs["chatml"]))
    ids, labels = tokenize_row({"prompt": "What is two plus two ?", "response": "four"}, tok)
    assert tok.tok.convert_ids_to_tokens(ids) == ["What", "is", "two", "plus", "two", "?",
                                                  "four", "[EOS]"]
    assert labels == [IGNORE_INDEX] * 6 + ids[6:]


@pytest.mark.parametrize("template", ["chatml", "generation", "content_gen"])
def test_chat_labels_exactly_the_assistant_turns(tok_dirs, template):
    """System, user and template text carry no loss; each assistant reply and its end-of-turn
    mark do. Prefix rendering (plain template) and HF's {% generation %} mask agree; a
    {% generation %} block is followed when it says otherwise (the mark left out)."""
    tok = load_tokenizer(str(tok_dirs[template]))
    ids, labels = tokenize_row({"messages": CHAT}, tok)
    assert tok.tok.convert_ids_to_tokens(ids) == [
        "<|im_start|>", "system", "Be", "brief", ".", "<|im_end|>",
        "<|im_start|>", "user", "What", "is", "two", "plus", "two", "?", "<|im_end|>",
        "<|im_start|>", "assistant", "four", "<|im_end|>",
        "<|im_start|>", "user", "And", "times", "three", "?", "<|im_end|>",
        "<|im_start|>", "assistant", "twelve", "<|im_end|>"]
    if template == "content_gen":
        assert labelled(tok, ids, labels) == ["four", "twelve"]
        return
    assert labelled(tok, ids, labels) == ["four", "<|im_end|>", "twelve", "<|im_end|>"]
    assert [i for i, lab in enumerate(labels) if lab != IGNORE_INDEX] == [17, 18, 28, 29]


def test_chat_labels_with_byte_level_bpe(tmp_path):
    """A trained byte-level BPE (real merges, whitespace inside tokens): the labelled tokens
    decode to exactly each reply, its end-of-turn mark and the newline the template puts
    after it; nothing of the prompt."""
    from tokenizers import decoders
    from transformers import AutoTokenizer
    from user_data import bpe_tokenizer

    texts = ["Be brief. What is two plus two? Four. And times three? Twelve."] * 20
    tok_dir = bpe_tokenizer(tmp_path / "bpe", texts, 300)
    hf = AutoTokenizer.from_pretrained(tok_dir)
    hf.backend_tokenizer.decoder = decoders.ByteLevel()  # bytes back to text in decode()
    hf.add_special_tokens({"additional_special_tokens": CONTROL})
    hf.chat_template = CHATML
    hf.save_pretrained(tok_dir)
    tok = load_tokenizer(str(tok_dir))
    chat = [{"role": "user", "content": "What is two plus two?"},
            {"role": "assistant", "content": "Four."},
            {"role": "user", "content": " And times three?"},
            {"role": "assistant", "content": " Twelve, of course."}]
    ids, labels = tokenize_row({"messages": chat}, tok)
    runs, run = [], []
    for i, lab in zip(ids, labels):
        if lab != IGNORE_INDEX:
            run.append(i)
        elif run:
            runs, run = runs + [run], []
    runs += [run] if run else []
    assert [tok.tok.decode(r) for r in runs] == ["Four.<|im_end|>\n",
                                                 " Twelve, of course.<|im_end|>\n"]
    assert tok.tok.decode(ids) == tok.tok.apply_chat_template(chat, tokenize=False)


def test_read_jsonl_and_saved_dataset(tmp_path):
    rows = [{"prompt": "a", "response": "b", "id": 3}, {"messages": CHAT}]
    assert read_sft_rows(write_jsonl(tmp_path / "rows.jsonl", [*rows, ""])) == \
        [{"prompt": "a", "response": "b"}, {"messages": CHAT}]
    import datasets

    datasets.Dataset.from_list([{"prompt": "p", "response": "r"}] * 2).save_to_disk(
        tmp_path / "ds")
    assert read_sft_rows(tmp_path / "ds") == [{"prompt": "p", "response": "r"}] * 2


# ---- bad input ----------------------------------------------------------------------------------
BAD_ROWS = {
    "neither": ([{"text": "hello"}], "neither 'messages' nor 'prompt' and 'response'"),
    "no assistant": ([{"messages": CHAT[:2]}], "no assistant turn"),
    "not json": (['{"prompt": "a", "response": '], "not a JSON line"),
    "empty file": ([], "is empty"),
    "bad message": ([{"messages": [{"role": "user"}]}], "message 0 is not"),
    "assistant first": ([{"messages": CHAT[2:]}], "starts with an assistant turn"),
    "empty response": ([{"prompt": "a", "response": ""}], "the response is empty"),
    "both forms": ([{"prompt": "a", "response": "b", "messages": CHAT}], "has both"),
    "not text": ([{"prompt": 1, "response": "b"}], "'prompt' is int"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_rows_name_file_line_and_fix(tmp_path, case):
    rows, problem = BAD_ROWS[case]
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "response": "ok"}, *rows])
    if case == "empty file":
        path.write_text("\n", encoding="utf-8")
    with pytest.raises(InputError, match="Fix:") as err:
        read_sft_rows(path)
    assert problem in str(err.value)
    assert f"[{path}{'' if case == 'empty file' else ':2'}]" in str(err.value)


def test_missing_file_and_dataset_without_train(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        read_sft_rows(tmp_path / "nope.jsonl")
    import datasets

    datasets.DatasetDict({"eval": datasets.Dataset.from_list([{"prompt": "p", "response": "r"}])}
                         ).save_to_disk(tmp_path / "dd")
    with pytest.raises(InputError, match="no 'train' split"):
        read_sft_rows(tmp_path / "dd")


def test_messages_need_a_chat_template(tok_dirs):
    with pytest.raises(InputError, match=r"\[bytes\] has no chat template.*Fix:"):
        tokenize_row({"messages": CHAT}, ByteTokenizer())
    path = str(tok_dirs["none"])
    with pytest.raises(InputError, match=rf"\[{path}\] has no chat template"):
        tokenize_row({"messages": CHAT}, load_tokenizer(path))
    slow = SimpleNamespace(apply_chat_template=None, chat_template=CHATML, is_fast=False,
                           name_or_path="slow-tok")  # a Python tokenizer: no offsets
    with pytest.raises(InputError, match=r"\[slow-tok\] is a slow .*Fix: load its fast"):
        tokenize_row({"messages": CHAT}, slow)


def test_template_rewriting_earlier_turns_is_refused(tok_dirs):
    """Prefix rendering would mislabel it: refused, pointing at {% generation %}."""
    with pytest.raises(InputError, match="rewrites earlier turns.*generation"):
        tokenize_row({"messages": CHAT}, load_tokenizer(str(tok_dirs["rewriting"])))


# ---- batch layouts ------------------------------------------------------------------------------
def doc(n: int, seed: int, prompt: int = 2) -> tuple[list[int], list[int]]:
    """A random document of `n` tokens (vocabulary 64) whose first `prompt` tokens are prompt."""
    ids = torch.randint(1, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return ids, [IGNORE_INDEX] * prompt + ids[prompt:]


def test_pad_batch_layout():
    docs = [doc(3, 0), doc(5, 1)]
    b = pad_batch(docs, pad_id=0, multiple_of=4)
    assert b["input_ids"].shape == (2, 8) and b["input_ids"].dtype == torch.long
    assert b["input_ids"][0].tolist() == docs[0][0] + [0] * 5
    assert b["attention_mask"].tolist() == [[1] * 3 + [0] * 5, [1] * 5 + [0] * 3]
    assert b["labels"][1].tolist() == docs[1][1] + [IGNORE_INDEX] * 3
    assert pad_batch(docs, pad_id=9)["input_ids"].shape == (2, 5)


def test_pack_layout_best_fit_truncation_and_positions():
    lengths = [5, 9, 4, 6, 3, 14]
    docs = [doc(n, i) for i, n in enumerate(lengths)]
    assert plan_rows([min(n, 12) for n in lengths], 12) == [[0, 2, 4], [1], [3], [5]]
    b = pack_documents(docs, seq_len=12, pad_id=0)
    assert set(b) == {"input_ids", "labels", "position_ids"}  # no attention_mask: HF's rule
    assert b["input_ids"].shape == (4, 12)
    assert b["input_ids"][0].tolist() == docs[0][0] + docs[2][0] + docs[4][0]
    assert b["position_ids"][0].tolist() == [*range(5), *range(4), *range(3)]
    assert b["position_ids"][1].tolist() == [*range(9), *range(3)]  # padding: its own segment
    first = [0, 5, 9]  # each document's first label is -100 (HF shifts labels in its loss)
    assert [b["labels"][0, i].item() for i in first] == [IGNORE_INDEX] * 3
    assert b["labels"][1, 9:].tolist() == [IGNORE_INDEX] * 3 and b["input_ids"][1, 9:].sum() == 0
    assert b["input_ids"][3].tolist() == docs[5][0][:12]  # truncated: the head is kept
    again = pack_documents(docs, seq_len=12, pad_id=0)
    assert all(torch.equal(b[k], again[k]) for k in b)


# ---- packed == one by one -----------------------------------------------------------------------
def tiny_model(family: str):
    """A float64 tiny causal LM of `family` (sdpa attention, HF's default here: its eager
    attention takes the softmax in float32, which would cost exactness, not isolation)."""
    import transformers as tf

    cfg = {"llama": lambda: tf.LlamaConfig(**LLAMA_LIKE),
           "qwen3": lambda: tf.Qwen3Config(**LLAMA_LIKE, head_dim=8),
           "gpt2": lambda: tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                         n_positions=64, bos_token_id=0, eos_token_id=0)}[family]()
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).double().eval()
    assert model.config._attn_implementation == "sdpa"
    return model


LLAMA_LIKE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def token_losses(model, batch: dict, keys: list[list[tuple[int, int]]], **kw) -> dict:
    """{(document, position in it): loss} of every labelled token, from the logits and the
    shifted labels; `keys[r][t]` names row r's token t."""
    logits = model(input_ids=batch["input_ids"], **kw).logits
    labels = batch["labels"]
    out = {}
    for r in range(labels.shape[0]):
        for t in range(1, labels.shape[1]):
            if labels[r, t] != IGNORE_INDEX:
                out[keys[r][t]] = torch.nn.functional.cross_entropy(logits[r, t - 1],
                                                                    labels[r, t])
    return out


def one_by_one(model, docs) -> dict:
    return {(d, t): loss for d, (ids, lab) in enumerate(docs) for (_, t), loss in token_losses(
        model, {"input_ids": torch.tensor([ids]), "labels": torch.tensor([lab])},
        [[(d, t) for t in range(len(ids))]], use_cache=False).items()}


def grads(model, losses: dict) -> torch.Tensor:
    model.zero_grad()
    torch.stack(list(losses.values())).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_packed_batch_equals_documents_one_by_one(family):
    model = tiny_model(family)
    docs = [doc(n, i, prompt=p) for i, (n, p) in enumerate([(5, 2), (9, 3), (4, 0), (6, 1),
                                                            (3, 1)])]
    batch = pack_documents(docs, seq_len=12)
    keys = [[(d, t) for d in row for t in range(len(docs[d][0]))] + [(-1, i) for i in range(12)]
            for row in plan_rows([len(ids) for ids, _ in docs], 12)]
    ref = one_by_one(model, docs)
    packed = token_losses(model, batch, keys, position_ids=batch["position_ids"],
                          use_cache=False)
    assert sorted(packed) == sorted(ref)  # the same tokens carry a loss
    a, b = (torch.stack([x[k] for k in sorted(ref)]) for x in (packed, ref))
    assert rel(a, b) <= 1e-10
    assert rel(grads(model, packed), grads(model, ref)) <= 1e-10

    padded = pad_batch(docs, pad_id=0)
    one_row = [[(d, t) for t in range(padded["input_ids"].shape[1])] for d in range(len(docs))]
    pads = token_losses(model, padded, one_row, attention_mask=padded["attention_mask"],
                        use_cache=False)
    assert rel(torch.stack([pads[k] for k in sorted(ref)]), b) <= 1e-10

    # mutations: what makes it exact is the document mask HF builds from the restarting
    # positions; plain arange positions (one long sequence), or a KV cache (HF skips the
    # packed-sequence mask then), let documents attend to each other
    arange = torch.arange(12).expand(batch["input_ids"].shape[0], -1)
    for kw in ({"position_ids": arange, "use_cache": False},
               {"position_ids": batch["position_ids"], "use_cache": True}):
        with torch.no_grad():
            wrong = token_losses(model, batch, keys, **kw)
        assert rel(torch.stack([wrong[k] for k in sorted(ref)]), b) > 1e-3, kw
