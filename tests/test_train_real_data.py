"""`slapo train` on the user's data, tokenizer and model: --data, --tokenizer, --model DIR.

Everything is built here, offline: a BPE tokenizer trained on the shipped corpus with
`tokenizers` and saved as a PreTrainedTokenizerFast directory, text/JSONL files and a
`datasets.save_to_disk` directory, and a small GPT-2 saved with `save_pretrained`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from user_data import bpe_tokenizer, user_files

from slapo.cli import main
from slapo.data import (
    IGNORE_INDEX,
    InputError,
    load_corpus,
    load_tokenizer,
    make_data,
    read_documents,
)

TINY = ["--hidden-size", "32", "--num-layers", "2", "--num-heads", "2", "--seq-len", "32",
        "--batch-size", "4", "--no-progress", "--no-plot", "--eval-batches", "1"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A 400-token BPE tokenizer trained on the shipped corpus, saved like any HF tokenizer."""
    return bpe_tokenizer(tmp_path_factory.mktemp("tok"), load_corpus().values(), 400)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    """The corpus as the user's files: .txt files and a .jsonl of paragraphs."""
    return user_files(tmp_path_factory.mktemp("text"), ("essays.txt", "poems.txt"))


def run(out: Path, *flags: str) -> dict:
    assert main(["train", *TINY, "--out", str(out), *flags]) == 0
    return json.loads((out / "metrics.json").read_text())


# ---- data -------------------------------------------------------------------------------------
def test_sources_text_glob_jsonl_and_saved_dataset(text_dir, tmp_path):
    docs = read_documents(str(text_dir / "*.txt"))
    assert docs.files == [str(text_dir / "essays.txt"), str(text_dir / "poems.txt")]
    assert not docs.by_record and docs.texts[0] == load_corpus()["essays.txt"]
    rows = read_documents(str(text_dir / "paras.jsonl"), text_field="body")
    assert rows.by_record and len(rows.texts) > 50
    both = read_documents(f"{text_dir / 'poems.txt'},{text_dir / 'paras.jsonl'}", "body")
    assert len(both.texts) == 1 + len(rows.texts)

    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": rows.texts[:40]}),
                               "validation": datasets.Dataset.from_dict(
                                   {"text": rows.texts[40:50]})})
    dd.save_to_disk(str(tmp_path / "ds"))
    saved = read_documents(str(tmp_path / "ds"))
    assert saved.texts == rows.texts[:40] and saved.val == rows.texts[40:50]


def test_packing_split_and_tokenizer(tok_dir, text_dir):
    tok = load_tokenizer(str(tok_dir))
    assert tok.vocab_size == 400 and tok.eos_id == 3 and tok.mask_id == 4
    data = make_data("causal", 32, seed=0, data=str(text_dir / "paras.jsonl"),
                     text_field="body", tokenizer=str(tok_dir), val_fraction=0.1)
    rows = read_documents(str(text_dir / "paras.jsonl"), "body").texts
    n_tokens = sum(len(ids) + 1 for ids in tok.encode_many(rows))  # + EOS after each record
    assert len(data.train.tokens) + len(data.val_tokens) == n_tokens
    assert 0.05 < len(data.val_tokens) / n_tokens < 0.2
    again = make_data("causal", 32, seed=0, data=str(text_dir / "paras.jsonl"),
                      text_field="body", tokenizer=str(tok_dir), val_fraction=0.1)
    assert torch.equal(again.train.tokens, data.train.tokens)  # deterministic split
    other = make_data("causal", 32, seed=1, data=str(text_dir / "paras.jsonl"),
                      text_field="body", tokenizer=str(tok_dir), val_fraction=0.1)
    assert not torch.equal(other.train.tokens, data.train.tokens)  # seeded
    b = data.train.next_batch(4)
    assert b["input_ids"].shape == (4, 32) and int(b["input_ids"].max()) < 400
    assert tok.decode(b["input_ids"][0])  # real text


def test_mlm_masking_is_seeded_and_skips_special_tokens(tok_dir, text_dir):
    def batch():
        data = make_data("masked", 64, seed=3, data=str(text_dir / "paras.jsonl"),
                         text_field="body", tokenizer=str(tok_dir))
        data.train.next_batch(8)
        return data.train.next_batch(8)

    b, again = batch(), batch()
    assert all(torch.equal(b[k], again[k]) for k in b)
    target = b["labels"] != IGNORE_INDEX
    assert 0.08 < target.float().mean() < 0.25
    assert not torch.isin(b["labels"][target], torch.tensor([0, 1, 2, 3, 4])).any()
    assert (b["input_ids"][target] == 4).float().mean() > 0.6  # mostly [MASK]


def test_train_on_files_with_tokenizer_resumes_exactly(tok_dir, text_dir, tmp_path):
    """--data + --tokenizer, with dropout: straight vs saved at 3 vs resumed from step 3."""
    flags = ["--data", str(text_dir / "*.txt"), "--tokenizer", str(tok_dir), "--steps", "6",
             "--dropout", "0.1", "--lr", "3e-3"]
    straight = run(tmp_path / "a", *flags, "--save-every", "3")
    assert straight["tokenizer"] == str(tok_dir) and straight["data"].endswith("*.txt")
    assert abs(straight["losses"][0] - math.log(400)) < 0.5  # the new vocabulary
    assert math.isfinite(straight["val_loss"])
    step3 = tmp_path / "a" / "checkpoints" / "step_000003"
    resumed = run(tmp_path / "b", *flags, "--resume", str(step3))
    assert resumed["losses"] == straight["losses"]


def test_resume_on_other_data_is_refused(tok_dir, text_dir, tmp_path, capsys):
    base = ["--tokenizer", str(tok_dir), "--steps", "2", "--eval-batches", "0"]
    run(tmp_path, *base, "--data", str(text_dir / "essays.txt"))
    rc = main(["train", *TINY, "--out", str(tmp_path), *base, "--steps", "3", "--resume",
               "--data", str(text_dir / "poems.txt")])
    assert rc == 1 and "different run: --data" in capsys.readouterr().err
    # same option, other contents: the token fingerprint in the checkpoint catches it
    (text_dir / "copy.txt").write_text(load_corpus()["essays.txt"], encoding="utf-8")
    run(tmp_path / "c", *base, "--data", str(text_dir / "copy.txt"))
    (text_dir / "copy.txt").write_text(load_corpus()["poems.txt"], encoding="utf-8")
    rc = main(["train", *TINY, "--out", str(tmp_path / "c"), *base, "--steps", "3",
               "--resume", "--data", str(text_dir / "copy.txt")])
    assert rc == 1 and "trained on other data" in capsys.readouterr().err
    (text_dir / "copy.txt").unlink()


def test_masked_lm_on_a_saved_dataset(tok_dir, text_dir, tmp_path):
    datasets = pytest.importorskip("datasets")

    rows = read_documents(str(text_dir / "paras.jsonl"), "body").texts
    datasets.Dataset.from_dict({"body": rows}).save_to_disk(str(tmp_path / "ds"))
    m = run(tmp_path / "run", "--model", "bert", "--data", str(tmp_path / "ds"),
            "--text-field", "body", "--tokenizer", str(tok_dir), "--steps", "4", "--lr", "5e-3",
            "--grad-accum", "2")
    assert len(m["losses"]) == 4 and all(math.isfinite(x) for x in m["losses"])
    assert m["task"] == "masked" and math.isfinite(m["val_loss"])


# ---- pretrained models ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, tok_dir) -> Path:
    """A small GPT-2 (vocab of the BPE tokenizer) saved with save_pretrained, tokenizer beside."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=400, n_embd=32, n_layer=2, n_head=2,
                                       n_positions=64, bos_token_id=2, eos_token_id=3))
    out = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tok_dir).save_pretrained(out)
    return out


def first_batch_loss(model_dir: Path, seq_len: int = 32, batch: int = 4) -> float:
    """The loss `from_pretrained` gives on the run's first batch (dropout off, as trained)."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(model_dir, resid_pdrop=0.0, embd_pdrop=0.0,
                                            attn_pdrop=0.0)
    data = make_data("causal", seq_len, seed=0, tokenizer=str(model_dir))
    with torch.no_grad():
        return float(model(**data.train.next_batch(batch)).loss)


def test_finetune_starts_from_the_saved_weights(gpt2_dir, tmp_path):
    m = run(tmp_path, "--model", str(gpt2_dir), "--steps", "3", "--lr", "1e-3")
    assert m["tokenizer"] == str(gpt2_dir)  # the model directory's own tokenizer
    assert m["losses"][0] == pytest.approx(first_batch_loss(gpt2_dir), rel=1e-6, abs=1e-6)
    assert m["losses"][-1] < m["losses"][0]


def test_config_file_trains_from_a_fresh_init(gpt2_dir, tmp_path):
    m = run(tmp_path, "--model", str(gpt2_dir / "config.json"), "--steps", "2",
            "--tokenizer", str(gpt2_dir))
    assert abs(m["losses"][0] - math.log(400)) < 0.3  # not the saved weights: a fresh init
    # the saved weights give first_batch_loss to 1e-6 (test above); a fresh init differs by more
    # (both are near log(V) for a barely trained model, so only the size of the gap tells)
    assert abs(m["losses"][0] - first_batch_loss(gpt2_dir)) > 1e-4


def test_local_piece_reads_exactly_the_shard(tmp_path):
    """Each rank's safetensors slice equals `sharding.local_slice` of the full tensor, for
    plain and fused (q|k|v, blocks=3) layouts and sizes torch.chunk cuts unevenly."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from slapo import sharding
    from slapo.train.pretrained import local_piece

    full = {"w": torch.randn(6, 30), "b": torch.randn(7)}
    save_file(full, str(tmp_path / "m.safetensors"))
    cases = [("w", 1, 3), ("w", 0, 1), ("w", 1, 1), ("b", 0, 1)]
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as fh:
        for name, axis, blocks in cases:
            for ws in (2, 3):
                for rank in range(ws):
                    spec = sharding.ShardSpec(tuple(full[name].shape), axis, ws, rank, blocks)
                    want = sharding.local_slice(full[name], axis, ws, rank, blocks)
                    got = local_piece(fh.get_slice(name), spec)
                    assert torch.equal(got, want), (name, axis, blocks, ws, rank)
        assert torch.equal(local_piece(fh.get_slice("w"), None), full["w"])


def job_tp_from_pretrained(options: dict) -> dict:
    """On each of 2 ranks: train with --tp 2 from the saved model, recording what was read."""
    import slapo.train.pretrained as pretrained
    from slapo.train import TrainConfig, train

    torch.set_num_threads(1)
    read = []
    original = pretrained.local_piece

    def spy(sl, spec):
        piece = original(sl, spec)
        read.append((piece.numel(), math.prod(sl.get_shape())))
        return piece

    pretrained.local_piece = spy
    try:
        m = train(TrainConfig(**options))
    finally:
        pretrained.local_piece = original
    return {"losses": m["losses"], "schedule": m["schedule"], "read": read}


@pytest.mark.dist
def test_tp2_run_starts_from_exactly_the_saved_weights(dist2, gpt2_dir):
    pytest.importorskip("slapo.model_schedule").apply  # noqa: B018
    options = dict(model=str(gpt2_dir), steps=2, seq_len=32, batch_size=4, progress=False,
                   plot=False, eval_batches=0, tp=2, attention="sdpa")
    ranks = dist2.run(job_tp_from_pretrained, options)
    assert ranks[0]["schedule"].startswith("applied: tp=2"), ranks[0]["schedule"]
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["losses"][0] == pytest.approx(first_batch_loss(gpt2_dir), rel=1e-5)
    for r in ranks:  # each rank read its shards, never the whole model
        got, total = sum(n for n, _ in r["read"]), sum(t for _, t in r["read"])
        assert got < 0.7 * total, (got, total)
        assert any(n * 2 == t for n, t in r["read"])  # halves of the sharded weights


@pytest.mark.dist
def test_pipeline_ranks_read_only_their_stages(dist2, gpt2_dir):
    """--pp-stages 2 from the saved model: each rank reads its own stage's tensors (the
    embeddings and the tied head on their ranks), training starts from exactly the saved
    weights, and trains like one process. The tied head must stay the embedding's tensor on
    each rank although each rank loads only one of its names: before, the two ranks' copies
    were separate tensors, their gradients were never summed, and from step 2 on the run
    drifted from one process (5.522 vs 5.517), silently."""
    options = dict(model=str(gpt2_dir), steps=3, seq_len=32, batch_size=4, progress=False,
                   plot=False, eval_batches=0)
    one = job_tp_from_pretrained(options)["losses"]
    ranks = dist2.run(job_tp_from_pretrained, {**options, "pp_stages": 2})
    assert ranks[0]["losses"][0] == pytest.approx(first_batch_loss(gpt2_dir), rel=1e-5)
    assert ranks[0]["losses"] == pytest.approx(one, rel=1e-5), (ranks[0]["losses"], one)
    total = sum(p.numel() for p in
                __import__("transformers").GPT2LMHeadModel.from_pretrained(gpt2_dir)
                .state_dict().values())
    for r in ranks:
        got = sum(n for n, _ in r["read"])
        assert 0 < got < 0.8 * total, (got, total)  # a stage, never the whole model
    assert sum(n for r in ranks for n, _ in r["read"]) >= 0.95 * total  # together: all of it


def _saved_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(
        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=320,
        decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0))


def _saved_bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=320, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def _saved_opt():
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(OPTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, vocab_size=320,
        max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0,
        attention_dropout=0.0))


def _saved_roberta():
    from transformers import RobertaConfig, RobertaForMaskedLM

    return RobertaForMaskedLM(RobertaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=320, max_position_embeddings=72, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


@pytest.mark.dist
@pytest.mark.parametrize("make", [_saved_t5, _saved_bert, _saved_opt, _saved_roberta],
                         ids=["t5", "bert", "opt", "roberta"])
def test_tied_pipeline_from_a_saved_model_trains_like_one_process(dist2, tmp_path, make):
    """T5 ties one tensor under four names (`shared`, both stacks' `embed_tokens` on the first
    stage, `lm_head` on the last), BERT and RoBERTa their word embedding to the MLM decoder on
    the last stage, OPT its embedding to `lm_head`: a 2-stage fine-tune from the saved model (no tokenizer beside it: the byte
    tokenizer) equals one process."""
    torch.manual_seed(0)
    make().save_pretrained(tmp_path)
    options = dict(model=str(tmp_path), steps=3, seq_len=32, batch_size=8, progress=False,
                   plot=False, eval_batches=0)
    one = job_tp_from_pretrained(options)["losses"]
    ranks = dist2.run(job_tp_from_pretrained, {**options, "pp_stages": 2})
    assert ranks[0]["losses"] == pytest.approx(one, rel=1e-5), (ranks[0]["losses"], one)


def _saved_llama():  # grouped-query attention: k/v have 2 heads for 4 query heads
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=64))


def _saved_qwen2():  # q/k/v projections with biases, sharded with their weights
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=64))


def _saved_gpt_neo():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    return GPTNeoForCausalLM(GPTNeoConfig(
        hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        window_size=16, vocab_size=320, max_position_embeddings=64, embed_dropout=0.0,
        resid_dropout=0.0, attention_dropout=0.0))


def _saved_albert():
    from transformers import AlbertConfig, AlbertForMaskedLM

    return AlbertForMaskedLM(AlbertConfig(
        hidden_size=32, embedding_size=16, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, vocab_size=320, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _saved_gpt2():  # one fused c_attn (q|k|v blocks), a Conv1D's transposed layout
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=320, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


SAVED = {"gpt2": _saved_gpt2, "t5": _saved_t5, "bert": _saved_bert, "opt": _saved_opt, "roberta": _saved_roberta,
         "llama": _saved_llama, "qwen2": _saved_qwen2, "gpt_neo": _saved_gpt_neo,
         "albert": _saved_albert}


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(SAVED))
def test_tp2_from_every_saved_family_trains_like_one_process(dist2, tmp_path, name):
    """--tp 2 from a saved model of every family: each rank reads only its shards of the
    saved tensors (`local_piece` per shard spec: GPT-2's fused q|k|v blocks, LLaMA's and Qwen2's
grouped k/v, Qwen2's q/k/v
    biases, T5's head-sharded position bias, ALBERT's one shared layer, the tied MLM decoders),
    and the run equals one process reading the whole file; a wrong slice has the right shape
    and would train silently wrong. Every tensor gets noise first: a fresh init's zero biases
    and unit norms read the same from any rank's range."""
    torch.manual_seed(0)
    model = SAVED[name]()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path)
    options = dict(model=str(tmp_path), steps=3, seq_len=32, batch_size=8, progress=False,
                   plot=False, eval_batches=0)
    one = job_tp_from_pretrained(options)["losses"]
    ranks = dist2.run(job_tp_from_pretrained, {**options, "tp": 2})
    assert ranks[0]["schedule"].startswith("applied: tp=2"), ranks[0]["schedule"]
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["losses"] == pytest.approx(one, rel=1e-5), (ranks[0]["losses"], one)
    for r in ranks:  # shards, never the whole model
        assert any(n * 2 == t for n, t in r["read"]), r["read"]


@pytest.mark.parametrize("name", sorted(SAVED))
def test_schedule_knobs_keep_every_saved_weight(tmp_path, name):
    """The weights are loaded after the schedule ran on the meta model: knobs that replace
    modules (fused q|k|v, the kernels' modules, the fused loss, selective checkpointing, SDPA)
    must leave nothing at its random init. The first loss equals the plain run's."""
    torch.manual_seed(0)
    model = SAVED[name]()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path)
    options = dict(model=str(tmp_path), steps=1, seq_len=32, batch_size=8, progress=False,
                   plot=False, eval_batches=0)
    knobs = dict(attention="sdpa", kernels=True, fused_loss=True, ckpt_ratio=1.0,
                 ckpt_policy="selective", fuse=name not in ("albert", "opt", "t5"))
    plain = job_tp_from_pretrained(options)["losses"]
    scheduled = job_tp_from_pretrained({**options, **knobs})
    assert "fused_loss" in scheduled["schedule"], scheduled["schedule"]
    assert scheduled["losses"] == pytest.approx(plain, rel=1e-5), (scheduled, plain)


# ---- bad input: a clear error naming the path and the fix, exit status 2, nothing written -----
def _bad_inputs(tmp_path: Path, text_dir: Path, tok_dir: Path) -> dict[str, tuple[list, str]]:
    (tmp_path / "empty_tok").mkdir()
    (tmp_path / "no_config").mkdir()
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 400,
                                                     "n_embd": 32, "n_layer": 1, "n_head": 2}))
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    return {
        "missing file": (["--data", str(tmp_path / "nope.txt")], "nope.txt"),
        "glob without match": (["--data", str(tmp_path / "*.md")], "*.md"),
        "unknown field": (["--data", str(text_dir / "paras.jsonl"), "--tokenizer",
                           str(tok_dir)], "paras.jsonl:1"),
        "tokenizer dir without files": (["--tokenizer", str(tmp_path / "empty_tok")],
                                        "empty_tok"),
        "no tokenizer dir": (["--tokenizer", str(tmp_path / "nowhere")], "nowhere"),
        "model dir without config": (["--model", str(tmp_path / "no_config")], "no_config"),
        "missing model dir": (["--model", str(tmp_path / "gone") + "/"], "gone"),
        "pickled weights": (["--model", str(pickled)], "pytorch_model.bin"),
    }


@pytest.mark.parametrize("case", ["missing file", "glob without match", "unknown field",
                                  "tokenizer dir without files", "no tokenizer dir",
                                  "model dir without config", "missing model dir",
                                  "pickled weights"])
def test_bad_input_exits_2_naming_the_path_and_fix(case, tmp_path, text_dir, tok_dir, capsys):
    flags, where = _bad_inputs(tmp_path, text_dir, tok_dir)[case]
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", *TINY, "--steps", "1", "--out", str(out), *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert where in err and "Fix:" in err, err
    assert not out.exists()  # nothing written


def test_unknown_field_error_lists_the_fields(text_dir):
    with pytest.raises(InputError, match=r"no field 'text' \(has: body, id\).*--text-field"):
        read_documents(str(text_dir / "paras.jsonl"))


# ---- engine knobs -----------------------------------------------------------------------------
def test_grad_accum_matches_the_whole_batch(tmp_path):
    """--grad-accum 2: two half-batch backwards per step give the whole-batch gradient (causal
    LM, equal tokens per sample), so the losses follow the same trajectory."""
    flags = ["--steps", "4", "--eval-batches", "0", "--lr", "1e-2"]
    whole = run(tmp_path / "a", *flags)["losses"]
    accum = run(tmp_path / "b", *flags, "--grad-accum", "2")["losses"]
    assert accum[0] == pytest.approx(whole[0], rel=1e-6)
    assert accum == pytest.approx(whole, rel=1e-5)
    with pytest.raises(SystemExit) as e:
        main(["train", *TINY, "--grad-accum", "3"])  # 4 samples do not split into 3
    assert e.value.code == 2


def test_train_step_accepts_a_batch_encoding():
    """HF's BatchEncoding (a Mapping, not a dict) trains like the same dict."""
    import copy

    from transformers import BatchEncoding, GPT2Config, GPT2LMHeadModel

    import slapo

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 64, (4, 8))
    losses = []
    for wrap in (dict, BatchEncoding):
        model, _ = slapo.build(slapo.create_schedule(copy.deepcopy(base)),
                               optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
                               grad_accum=2)
        losses.append([model.train_step(wrap({"input_ids": ids, "labels": ids}))
                       for _ in range(2)])
    assert losses[0] == losses[1]


@pytest.mark.dist
def test_finetune_own_text_bf16_tp2_resumes_exactly(dist2, gpt2_dir, text_dir, tmp_path):
    """The issue's journey on 2 ranks: a saved GPT-2, the user's text files and tokenizer,
    bf16 autocast, TP=2, a checkpoint at step 2, resumed: bit-identical losses."""
    pytest.importorskip("slapo.model_schedule").apply  # noqa: B018
    options = dict(model=str(gpt2_dir), data=str(text_dir / "*.txt"), steps=4, seq_len=32,
                   batch_size=4, progress=False, plot=False, eval_batches=1, tp=2,
                   attention="sdpa", precision="bf16", dropout=0.1)
    straight = dist2.run(job_tp_from_pretrained, {**options, "out": str(tmp_path / "a"),
                                                  "save_every": 2})
    step2 = tmp_path / "a" / "checkpoints" / "step_000002"
    resumed = dist2.run(job_tp_from_pretrained, {**options, "out": str(tmp_path / "b"),
                                                 "resume": str(step2)})
    assert straight[0]["losses"] == straight[1]["losses"]
    assert resumed[0]["losses"] == straight[0]["losses"]
    assert all(math.isfinite(x) for x in straight[0]["losses"])


def test_toml_takes_the_new_options(tmp_path, text_dir, tok_dir):
    from slapo.cli import parse_train_args

    (tmp_path / "run.toml").write_text(
        f'data = ["{text_dir / "poems.txt"}", "{text_dir / "paras.jsonl"}"]\n'
        f'[data_options]\ntext-field = "body"\ntokenizer = "{tok_dir}"\nval-fraction = 0.2\n'
        '[engine]\ngrad-accum = 2\ndp-shard = true\npp-schedule = "GPipe"\n')
    cfg = parse_train_args(["--config", str(tmp_path / "run.toml"), "--grad-accum", "4"])
    assert cfg.data == f"{text_dir / 'poems.txt'},{text_dir / 'paras.jsonl'}"
    assert (cfg.text_field, cfg.tokenizer, cfg.val_fraction) == ("body", str(tok_dir), 0.2)
    assert (cfg.grad_accum, cfg.dp_shard, cfg.pp_schedule) == (4, True, "GPipe")
