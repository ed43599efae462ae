"""Supervised fine-tuning (SFT) data: prompt/response and chat rows, loss on the responses only,
and two batch layouts (one document per row, or documents packed behind a document mask).

    rows = read_sft_rows("chat.jsonl")                    # or a `save_to_disk` directory
    docs = [tokenize_row(r, tokenizer) for r in rows]     # (input_ids, labels) per row
    batch = pack_documents(docs, seq_len=2048)            # input_ids, labels, position_ids
    loss = model(**batch, use_cache=False).loss           # use_cache=False: see "Packing"

Formats (one JSON object per line, or the columns of a `datasets.save_to_disk` directory;
its `train` split when it is a DatasetDict):
- `{"prompt": str, "response": str}`: tokens = prompt + response + EOS, each part encoded on
  its own without the tokenizer's specials (as `slapo.data` encodes documents), so the boundary
  between "no loss" and "loss" is exact whatever the tokenizer merges; the texts are joined as
  written (put the space or newline between them in the data). No BOS is added, and no chat
  template is applied: works with the byte tokenizer and any HF tokenizer.
- `{"messages": [{"role": ..., "content": str}, ...]}`: rendered with the tokenizer's own chat
  template (`apply_chat_template`, which also writes the template's BOS and end-of-turn marks);
  it needs an HF tokenizer with a template (the byte tokenizer has none: InputError). At least
  one assistant turn, and not as the first message (nothing would prompt it).
Every problem is an `InputError` naming the file and line (or the tokenizer) and the fix, raised
before anything is returned.

Loss mask: labels are the input ids on response tokens and -100 (HF's ignore index) elsewhere.
For prompt/response that is the response tokens and the EOS. For messages it is each assistant
turn, found in one of two ways:
- the template marks its assistant text with `{% generation %}`: HF's
  `return_assistant_tokens_mask` (the template author says exactly what the model generates);
- otherwise (most published templates) by rendering prefixes: an assistant turn i spans the
  characters from the end of `render(messages[:i], add_generation_prompt=True)` (so the
  template's "assistant" header is prompt) to the end of `render(messages[:i + 1])` (so its
  end-of-turn mark is learnt: the model must learn to stop). Character spans, not token counts,
  because a BPE token can straddle the boundary of two separately tokenised prefixes; the
  whole conversation is tokenised once and a token is labelled when its character offsets
  overlap a span (HF's rule for `{% generation %}`). Both need a fast tokenizer (offsets). A
  template that rewrites earlier turns once later ones follow (e.g. drops earlier reasoning)
  makes a prefix not a prefix of the whole: InputError, with the `{% generation %}` fix. A
  template without a generation prompt leaves its assistant header inside the span (labelled).

Batch layouts:
- `pad_batch`: one document per row, right-padded to the longest (optionally to a multiple),
  with `attention_mask`; labels -100 on padding.
- `pack_documents`: whole documents packed greedily (best fit, in input order, deterministic)
  into rows of exactly `seq_len` tokens. A document longer than `seq_len` is **truncated** to
  its first `seq_len` tokens (not split: the tail of a split conversation would be trained
  without the prompt it answers). `position_ids` restart at 0 for every document (and for the
  tail padding), there is no `attention_mask`, and labels are -100 on each document's first
  token (HF shifts labels inside its loss, so that label would be predicted from the previous
  document's last token) and on the padding.

Packing: given `position_ids` and `attention_mask=None`, transformers' `create_causal_mask`
finds where the positions restart (`masking_utils.find_packed_sequence_indices`) and adds
`packed_sequence_mask_function`: a block-diagonal causal mask, so each document attends only
to itself and has its own positions, i.e. a packed row computes what its documents compute one
by one (HF's `DataCollatorWithFlattening` uses the same format). It is skipped, silently, when
a cache exists: the forward must get `use_cache=False` (the default `config.use_cache=True`
makes a DynamicCache and the documents then attend to each other; Slapo's schedules already
pass it, `slapo/model_schedule/no_cache.py`), and it must get no `attention_mask`.

Which families honour it (transformers 5.24, CPU): a one-off sweep built a tiny float64 model
of every causal LM in HF's tensor-parallel list (`tests/hf_tiny.py`, one layer of each kind a
hybrid mixes) plus gpt2, opt, bloom, biogpt, xglm and friends, packed 3 documents in one row,
and checked (a) that changing one document changes nothing in the others' logits and (b) that
the logits equal each document's own forward.
- Isolated and equal to float64 roundoff (sdpa): llama, mistral, ministral, qwen2, qwen3,
  qwen2_moe, qwen3_moe, mixtral, gemma, gemma3_text, gemma3n_text, gemma4_text, cohere,
  cohere2, phi, phi3, phimoe, gpt2, gpt_bigcode, gpt_neox, gptj, codegen, starcoder2, olmo,
  olmo2, olmo3, olmoe, granite, granitemoe, stablelm, smollm3, glm, glm4, glm4_moe, deepseek_v2,
  deepseek_v3, exaone4, nemotron, helium, internlm3, llama4_text, minicpm3, ernie4_5, seed_oss,
  arcee, apertus: 85 of the 123 model types that built.
- Isolated, equal to ~1e-7 only (9): eager attention (HF's eager path takes its softmax in
  float32; LLaMA switched to eager shows it too): gemma2, vaultgemma, granite_swa,
  granitemoe_swa, flint; and MoE models with a float32 router: dots1, laguna, kolibri1, hy_v4.
- Documents leak into each other (26; do not pack them): opt, bloom, biogpt (positions or
  ALiBi from the attention mask), models with recurrent, convolution, linear-attention or
  state-space layers (lfm2 with its conv layers, lfm2_moe, qwen3_next, qwen3_5, jamba, bamba,
  falcon_h1, nemotron_h, granitemoehybrid, kimi_linear, minimax, olmo_hybrid, ...), gpt_oss,
  afmoe and deepseek_v4; xglm's packed forward fails.
`tests/test_sft_data.py` keeps the proof for LLaMA, Qwen3 and GPT-2 (per-token losses and
gradients, float64), and shows that plain `arange` positions, or a cache, break it.

Not done here: `slapo train` does not read SFT rows yet (no `--data chat.jsonl` path, no packed
loader, sampler state or fingerprint for them); flash-attention's varlen path (HF derives
`cu_seqlens` from the same `position_ids`; untested, no GPU here); Slapo's pipeline stages and
context parallelism build their own masks and positions and do not see packed documents;
`sanitize_control_tokens` (user text that spells a control token is tokenised as that token).
"""

from __future__ import annotations

import bisect
import json
import re
from pathlib import Path
from typing import Any

import torch

from .dataset import IGNORE_INDEX
from .sources import InputError, is_saved_dataset, load_saved_dataset

Doc = tuple[list[int], list[int]]  # (input_ids, labels) of one document
Row = dict[str, Any]               # {"prompt", "response"} or {"messages"}

ROW_FIX = ('write each line as {"prompt": "...", "response": "..."} or '
           '{"messages": [{"role": "user", "content": "..."}, '
           '{"role": "assistant", "content": "..."}]}.')
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


# ---- reading ------------------------------------------------------------------------------------
def read_sft_rows(path: str | Path) -> list[Row]:
    """Every row of a JSONL file or a `save_to_disk` directory, checked (see the module
    docstring for the two forms); any bad row raises InputError before anything is returned."""
    p = Path(path)
    if is_saved_dataset(p):
        return _dataset_rows(p)
    if not p.is_file():
        raise InputError(str(p), "no such file.", "pass a .jsonl file of SFT rows or a "
                         "directory written by datasets' save_to_disk.")
    rows: list[Row] = []
    try:
        with open(p, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    rows.append(check_row(_json_line(line, f"{p}:{n}"), f"{p}:{n}"))
    except UnicodeDecodeError as e:
        raise InputError(str(p), f"not UTF-8 text ({e}).", "convert it to UTF-8.") from None
    if not rows:
        raise InputError(str(p), "is empty: it holds no JSON line.", ROW_FIX)
    return rows


def _json_line(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(where, f"not a JSON line ({e}).", ROW_FIX) from None


def check_row(row: Any, where: str) -> Row:
    """The row in one of the two forms (extra fields dropped), or InputError naming `where`.
    A field that is None counts as absent (a saved dataset with both forms' columns)."""
    if not isinstance(row, dict):
        raise InputError(where, f"a JSON {type(row).__name__}, not an object.", ROW_FIX)
    present = {k for k, v in row.items() if v is not None}
    if "messages" in present and present & {"prompt", "response"}:
        raise InputError(where, "has both 'messages' and 'prompt'/'response'.",
                         "keep one form per row.")
    if "messages" in present:
        return {"messages": _check_messages(row["messages"], where)}
    if {"prompt", "response"} <= present:
        return _check_prompt_response(row, where)
    raise InputError(where, f"neither 'messages' nor 'prompt' and 'response' (has: "
                     f"{', '.join(sorted(present)) or 'nothing'}).", ROW_FIX)


def _check_prompt_response(row: dict, where: str) -> Row:
    for key in ("prompt", "response"):
        if not isinstance(row[key], str):
            raise InputError(where, f"{key!r} is {type(row[key]).__name__}, not text.", ROW_FIX)
    if not row["response"]:
        raise InputError(where, "the response is empty: nothing to learn.",
                         "drop the row or write its response.")
    return {"prompt": row["prompt"], "response": row["response"]}


def _check_messages(messages: Any, where: str) -> list[dict]:
    """Each message a {"role": str, "content": str}; an assistant turn, not the first one."""
    if not isinstance(messages, list) or not messages:
        raise InputError(where, "'messages' is not a non-empty list.", ROW_FIX)
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise InputError(where, f"message {i} is not {{'role': str, 'content': str}} "
                             f"(got {m!r:.80}).", ROW_FIX)
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise InputError(where, f"the conversation has no assistant turn (roles: "
                         f"{', '.join(roles)}): there is nothing to learn.",
                         "add the assistant's reply as {\"role\": \"assistant\", ...}.")
    if roles[0] == "assistant":
        raise InputError(where, "the conversation starts with an assistant turn: nothing "
                         "prompts it.", "start with a system or user message.")
    return [dict(m) for m in messages]


def _dataset_rows(path: Path) -> list[Row]:
    """The rows of a saved dataset (a DatasetDict's `train` split), checked row by row."""
    import datasets

    ds = load_saved_dataset(path)
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"]
    rows = [check_row(row, f"{path} row {i}") for i, row in enumerate(ds)]
    if not rows:
        raise InputError(str(path), "the dataset has no row.", ROW_FIX)
    return rows


# ---- tokenizing ---------------------------------------------------------------------------------
def tokenize_row(row: Row, tokenizer) -> Doc:
    """(input_ids, labels) of one checked row: labels -100 except on what the model should
    learn to write (the response and its EOS; the assistant turns). `tokenizer`: Slapo's
    ByteTokenizer or HFTokenizer, or a transformers tokenizer itself."""
    if "messages" in row:
        return _chat_tokens(row["messages"], tokenizer)
    prompt = _encode(tokenizer, row["prompt"])
    response = _encode(tokenizer, row["response"]) + _eos(tokenizer)
    return prompt + response, [IGNORE_INDEX] * len(prompt) + response


def _hf(tokenizer):
    """The transformers tokenizer behind `tokenizer` (None for the byte tokenizer)."""
    return tokenizer if hasattr(tokenizer, "apply_chat_template") else getattr(tokenizer, "tok",
                                                                               None)


def _name(tokenizer) -> str:
    hf = _hf(tokenizer)
    return str(getattr(tokenizer, "name", None) or getattr(hf, "name_or_path", None)
               or type(tokenizer).__name__)


def _encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` without the tokenizer's own specials."""
    hf = _hf(tokenizer)
    return list(hf(text, add_special_tokens=False)["input_ids"]) if hf is not None \
        else tokenizer.encode(text)


def _eos(tokenizer) -> list[int]:
    """[EOS] (Slapo's `eos_id`: EOS, else SEP), or [] when the tokenizer has none."""
    eos = getattr(tokenizer, "eos_id", None)
    if eos is None and _hf(tokenizer) is tokenizer:
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None \
            else tokenizer.sep_token_id
    return [] if eos is None else [eos]


def _chat_tokenizer(tokenizer):
    """The HF tokenizer to render `messages` with, or InputError naming it and the fix: it
    needs a chat template, and character offsets (a fast tokenizer) to find the assistant
    tokens in the rendered text."""
    hf = _hf(tokenizer)
    if hf is None or not getattr(hf, "chat_template", None):
        raise InputError(_name(tokenizer), "has no chat template, which a 'messages' row "
                         "needs.", "pass --tokenizer DIR of a chat model (its "
                         "tokenizer_config.json or chat_template.jinja holds the template), set "
                         "tokenizer.chat_template and save_pretrained, or write the rows as "
                         "{\"prompt\", \"response\"}.")
    if not getattr(hf, "is_fast", False):
        raise InputError(_name(tokenizer), "is a slow (Python) tokenizer: it gives no "
                         "character offsets, which finding the assistant tokens needs.",
                         "load its fast tokenizer (tokenizer.json; AutoTokenizer's default).")
    return hf


def _chat_tokens(messages: list[dict], tokenizer) -> Doc:
    hf = _chat_tokenizer(tokenizer)
    if _GENERATION.search(hf.get_chat_template()):
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    else:
        text, spans = _assistant_spans(hf, messages)
        ids, mask = _tokens_in_spans(hf, text, spans)
    if not any(mask):
        raise InputError(_name(tokenizer), "its chat template renders no assistant token for "
                         "this conversation.", "check the template writes the assistant "
                         "content (and its {% generation %} block, if it has one).")
    return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]


def _render(hf, messages: list[dict], generation_prompt: bool) -> str:
    return hf.apply_chat_template(messages, tokenize=False,
                                  add_generation_prompt=generation_prompt)


def _assistant_spans(hf, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and each assistant turn's character span, from the renderings
    of its prefixes (see the module docstring); InputError when a prefix renders differently
    from the start of the whole (the spans would be wrong)."""
    text = _render(hf, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = _render(hf, messages[:i], True), _render(hf, messages[:i + 1], False)
        if not (text.startswith(before) and text.startswith(through)):
            raise InputError(str(hf.name_or_path), "its chat template renders the conversation "
                             f"up to message {i} differently inside the whole conversation (it "
                             "rewrites earlier turns), so the assistant text cannot be found "
                             "from prefixes.", "wrap the assistant content in the template in "
                             "{% generation %}...{% endgeneration %} (HF's "
                             "return_assistant_tokens_mask is used then).")
        spans.append((len(before), len(through)))
    return text, spans


def _tokens_in_spans(hf, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """Token ids of `text` (no added specials: the template wrote them) and, per token,
    whether its characters overlap one of `spans`."""
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(a < e and b > s for s, e in spans) for a, b in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


# ---- batches ------------------------------------------------------------------------------------
def pad_batch(docs: list[Doc], pad_id: int, multiple_of: int | None = None
              ) -> dict[str, torch.Tensor]:
    """One document per row, right-padded to the longest document (rounded up to
    `multiple_of`): input_ids, attention_mask (0 on padding), labels (-100 on padding)."""
    if not docs:
        raise ValueError("pad_batch: no documents")
    width = max(len(ids) for ids, _ in docs)
    if multiple_of:
        width = -(-width // multiple_of) * multiple_of
    input_ids = torch.full((len(docs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(docs), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(docs), width), dtype=torch.long)
    for r, (ids, lab) in enumerate(docs):
        input_ids[r, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[r, :len(ids)] = torch.tensor(lab, dtype=torch.long)
        attention_mask[r, :len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def pack_documents(docs: list[Doc], seq_len: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Rows of exactly `seq_len` tokens holding whole documents (longer ones truncated to their
    first `seq_len` tokens): input_ids, labels, position_ids. No attention_mask on purpose: HF
    builds the document mask from the restarting positions (module docstring). Padding is
    `pad_id` (never attended to by a document, never labelled)."""
    if seq_len < 1:
        raise ValueError(f"pack_documents: seq_len must be >= 1, got {seq_len}")
    cut = [(list(ids[:seq_len]), list(lab[:seq_len])) for ids, lab in docs if len(ids)]
    if not cut:
        raise ValueError("pack_documents: no non-empty document")
    rows = [_packed_row([cut[i] for i in row], seq_len, pad_id)
            for row in plan_rows([len(ids) for ids, _ in cut], seq_len)]
    return {key: torch.tensor([row[k] for row in rows], dtype=torch.long)
            for k, key in enumerate(("input_ids", "labels", "position_ids"))}


def plan_rows(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Which documents go in which row: best fit in input order (each document joins the row
    with the least room that still holds it, the earlier row on a tie, else opens a row).
    Deterministic, O(n log n), and fuller rows than next-fit, without reordering the input
    within a row."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row number), sorted
    for i, n in enumerate(lengths):
        k = bisect.bisect_left(free, (n, -1))
        if k == len(free):
            rows.append([i])
            room, r = seq_len - n, len(rows) - 1
        else:
            room, r = free.pop(k)
            rows[r].append(i)
            room -= n
        if room > 0:
            bisect.insort(free, (room, r))
    return rows


def _packed_row(docs: list[Doc], seq_len: int, pad_id: int
                ) -> tuple[list[int], list[int], list[int]]:
    """One row: the documents, then padding; positions restart at 0 for each document and for
    the padding; a document's first label is -100 (it would be predicted across the border)."""
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    for d_ids, d_labels in docs:
        ids += d_ids
        labels += [IGNORE_INDEX] + d_labels[1:]
        pos += range(len(d_ids))
    pad = seq_len - len(ids)
    return ids + [pad_id] * pad, labels + [IGNORE_INDEX] * pad, pos + list(range(pad))
