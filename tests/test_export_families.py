"""`slapo export` of every family `slapo train --model DIR` trains, in every layout.

A model from a directory is built with its parameters on the meta device and its buffers as its
constructor computes them (`ModelSource.build_empty`); export must rebuild it the same way.
It once re-allocated every tensor (`to_empty`), so the non-persistent buffers no checkpoint
holds (LLaMA's rotary `inv_freq`, BERT's `position_ids`) became uninitialised memory: wrong
logits or an index error, only for directory models (registry models are built for real).

Per layout (one process, TP=2, PP=2, FSDP2 over 2 ranks), one job trains every family in turn
(`slapo train`'s own entry point), rebuilds each run from its checkpoint the way `--resume`
does and returns the trained model's logits (a pipeline rank: the parameters it trained);
the test then exports each run and checks the export's own reload check and, independently,
`from_pretrained` of the exported directory against those logits / parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sweep
import torch

from slapo.train.export import export_run

TINY = dict(seq_len=16, batch_size=4, steps=2, save_every=2, progress=False, plot=False,
            eval_batches=0, dropout=0.0, lr=1e-2)
PROBE = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
VOCAB = 260  # the byte tokenizer's (a directory without a tokenizer trains on bytes)
# gemma2, phi3 and qwen2_moe have no hand-written family: scheduled from the tp plan their
# configs declare (`model_schedule/hf_plan.py`; Gemma 2: soft-capping, alternating sliding
# windows, scaled embeddings; Phi-3: packed q|k|v and gate|up; Qwen2-MoE: experts split per
# expert FFN, read from save_pretrained's per-expert keys, and shared experts)
FAMILIES = ("gpt2", "gpt_neo", "opt", "llama", "mistral", "qwen2", "qwen3", "bert", "roberta",
            "albert", "t5", "gemma2", "phi3", "qwen2_moe")
LAYOUTS = {"one": {}, "tp2": {"tp": 2}, "pp2": {"pp_stages": 2}, "fsdp2": {"dp_shard": True}}
# A layout `slapo train` refuses for a family, with the reason (checked to be refused).
# (gemma2 and qwen2_moe pipeline from their declared pp plan: runtime/stages_declared.py)
REFUSED = {("albert", "pp2"): "one shared layer at every depth"}


def _config(name: str):
    """A tiny config of each family (2 layers, width 32, 4 heads, 2 key/value heads)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, pad_token_id=256, bos_token_id=257, eos_token_id=258)
    decoder = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                   tie_word_embeddings=False, **common)
    encoder = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=64, max_position_embeddings=64, **common)
    return {
        "gpt2": lambda: tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **common),
        "gpt_neo": lambda: tf.GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=4,
                                           attention_types=[[["global", "local"], 1]],
                                           window_size=8, max_position_embeddings=64, **common),
        "opt": lambda: tf.OPTConfig(hidden_size=32, word_embed_proj_dim=32, num_hidden_layers=2,
                                    num_attention_heads=4, ffn_dim=64,
                                    max_position_embeddings=64, **common),
        "llama": lambda: tf.LlamaConfig(**decoder),
        "mistral": lambda: tf.MistralConfig(**decoder, sliding_window=None),
        "qwen2": lambda: tf.Qwen2Config(**decoder),
        "qwen3": lambda: tf.Qwen3Config(**decoder, head_dim=8),
        "bert": lambda: tf.BertConfig(**encoder),
        # RoBERTa numbers positions from pad_token_id + 1
        "roberta": lambda: tf.RobertaConfig(**{**encoder, "max_position_embeddings": 64 + 257}),
        "albert": lambda: tf.AlbertConfig(**encoder, embedding_size=16),
        "gemma2": lambda: tf.Gemma2Config(**decoder, head_dim=8, sliding_window=8),
        "phi3": lambda: tf.Phi3Config(**decoder),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**decoder, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=32,
                                               shared_expert_intermediate_size=64),
        "t5": lambda: tf.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                                  num_heads=4, vocab_size=VOCAB, pad_token_id=256,
                                  eos_token_id=258, decoder_start_token_id=256),
    }[name]()


TASK_CLASS = {"gpt2": "GPT2LMHeadModel", "gpt_neo": "GPTNeoForCausalLM", "opt": "OPTForCausalLM",
              "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM",
              "albert": "AlbertForMaskedLM", "t5": "T5ForConditionalGeneration",
              "gemma2": "Gemma2ForCausalLM", "phi3": "Phi3ForCausalLM",
              "qwen2_moe": "Qwen2MoeForCausalLM"}


def families_in(layout: str) -> list[str]:
    """The families a layout's test trains: all of them in one process and with
    SLAPO_SWEEP=all; by default (tests/sweep.py) each parallel layout takes 6 in turn, so every
    family is exported from one parallel layout besides the one process, and the refusals."""
    if layout == "one":
        return list(FAMILIES)
    parallel = [k for k in LAYOUTS if k != "one"]
    picked = sweep.spread(FAMILIES, parallel, 6, skip=REFUSED)
    return [f for f in FAMILIES if (f, layout) in picked or (f, layout) in REFUSED]


def save_family_dirs(root: Path, names: list[str] = FAMILIES) -> dict[str, str]:
    """The families `names` saved with `save_pretrained` (config.json + model.safetensors)."""
    import transformers as tf

    dirs = {}
    for i, name in enumerate(FAMILIES):
        if name not in names:
            continue
        torch.manual_seed(i)
        model = getattr(tf, TASK_CLASS[name])(_config(name))
        model.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def probe(name: str) -> dict:
    if name == "t5":
        return {"input_ids": PROBE, "decoder_input_ids": PROBE[:, :6]}
    return {"input_ids": PROBE}


def job_train_every_family(dirs: dict[str, str], root: str, layout: str) -> dict:
    """Every rank (or the one process): for each family, `slapo train --model DIR` two steps
    (checkpoint at the end), then rebuild the run from its checkpoint as `--resume` does and
    return the trained logits (a pipeline rank: the parameters it trained, by name)."""
    from slapo.errors import SlapoError
    from slapo.train import TrainConfig, train
    from slapo.train.assemble import build
    from slapo.train.resume import resume
    from slapo.train.setup import setup, teardown

    torch.set_num_threads(1)
    quiet = lambda *a, **k: None  # noqa: E731
    results = {}
    for name, directory in dirs.items():
        opts = {**TINY, **LAYOUTS[layout], "model": directory,
                "out": str(Path(root) / f"{layout}-{name}")}
        if (name, layout) in REFUSED:
            with pytest.raises(SlapoError, match=REFUSED[name, layout]):
                train(TrainConfig(**opts))
            continue
        train(TrainConfig(**opts))
        cfg = TrainConfig(**{**opts, "resume": "latest"})
        env = setup(cfg)
        try:
            run = build(cfg, env, log=quiet)
            resume(run, log=quiet)
            if layout == "pp2":
                owned = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
                results[name] = {"params": {n: p.detach().clone() for n, p in
                                            run.model.named_parameters() if id(p) in owned}}
                continue
            run.model.eval()
            with torch.no_grad():
                results[name] = {"logits": run.model(**probe(name)).logits.detach().clone()}
        finally:
            teardown(env)
    return results


def _check_exports(root: Path, layout: str, ranks: list[dict]) -> None:
    import transformers as tf

    for name in families_in(layout):
        if (name, layout) in REFUSED:
            continue
        run, hf = root / f"{layout}-{name}", root / f"{layout}-{name}-hf"
        result = export_run(run, hf, log=lambda *a: None)  # its own reload check: exact
        assert result.step == 2 and result.max_logit_diff == 0.0, name
        assert not hf.with_name(hf.name + ".tmp").exists()
        info = json.loads((hf / "slapo_export.json").read_text())
        assert info["run_id"] == json.loads((run / "run.json").read_text())["run_id"]
        model = getattr(tf, TASK_CLASS[name]).from_pretrained(str(hf), local_files_only=True)
        model.eval()
        if layout == "pp2":  # every stage's trained tensors, exactly, from the rank that owns it
            exported, seen = dict(model.named_parameters()), set()
            for r in ranks:
                for key, value in r[name]["params"].items():
                    assert torch.equal(exported[key], value), (name, key)
                    seen.add(key)
            assert seen == set(exported), (name, set(exported) - seen)
            continue
        with torch.no_grad():
            got = model(**probe(name)).logits
        # the run's schedule (SDPA, TP all-reduces) sums in another order than HF eager
        for r in ranks:
            torch.testing.assert_close(got, r[name]["logits"], rtol=1e-4, atol=1e-4,
                                       msg=lambda m, n=name: f"{n}: {m}")


def test_export_of_every_family_from_a_directory_one_process(tmp_path, one_thread):
    dirs = save_family_dirs(tmp_path / "src")
    res = job_train_every_family(dirs, str(tmp_path), "one")
    _check_exports(tmp_path, "one", [res])


@pytest.mark.dist
@pytest.mark.parametrize("layout", ["tp2", "pp2",
                                    pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_export_of_every_family_from_a_directory(dist2, tmp_path, layout):
    dirs = save_family_dirs(tmp_path / "src", families_in(layout))
    ranks = dist2.run(job_train_every_family, dirs, str(tmp_path), layout, timeout=600)
    _check_exports(tmp_path, layout, ranks)


def test_a_buffer_no_checkpoint_holds_and_no_constructor_computed_is_refused(tmp_path):
    """Buffers the constructor computed are kept (none left on meta); if a model ever left a
    non-persistent buffer on meta, export could fill it from nothing: refused, naming it
    (never uninitialised memory in the export)."""
    import transformers as tf

    from slapo.data.sources import InputError
    from slapo.train.export import allocate_for_checkpoint
    from slapo.train.pretrained import model_source

    tf.LlamaForCausalLM(_config("llama")).save_pretrained(tmp_path / "llama")
    source = model_source(str(tmp_path / "llama"))
    built = source.build_empty()
    expected = built.model.rotary_emb.inv_freq.clone()
    model = allocate_for_checkpoint(built, "x")
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert torch.equal(model.model.rotary_emb.inv_freq, expected)
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied: two tensors
    broken = source.build_empty()
    broken.model.rotary_emb.inv_freq = broken.model.rotary_emb.inv_freq.to("meta")
    with pytest.raises(InputError, match="model.rotary_emb.inv_freq is built on the meta"):
        allocate_for_checkpoint(broken, str(tmp_path / "llama"))
