"""`slapo train --data ROWS --sft pack|pad` (issue 35): supervised fine-tuning rows as the run's
data. The run's first loss is the model's own loss on the first batch the loader draws, with
the KV cache off (packed documents are kept apart by HF's mask, which a cache would skip:
`slapo.data.sft`); only response tokens carry labels; a run saved and resumed draws the same
rows; `--tp 2` trains like one process; bad combinations are refused before anything is built.
The packing itself (packed == documents one by one) is tests/test_sft_data.py's."""

from __future__ import annotations

import json

import pytest
import torch

TRAIN = dict(model="llama", hidden_size=32, num_layers=2, num_heads=4, seq_len=128,
             batch_size=4, steps=3, progress=False, plot=False, eval_batches=0, dropout=0.0,
             lr=1e-2)


def write_rows(path, n: int = 24) -> str:
    """Prompt/response rows of varied lengths (the byte tokenizer: one token per byte)."""
    rows = [{"prompt": f"Q{i}: what is {i} plus {i * 3}? ",
             "response": f"It is {4 * i}." + " Yes." * (i % 4)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _first_batch_loss(cfg) -> tuple[float, dict]:
    """The model the run builds (same seed) on the first batch its loader draws, cache off."""
    from slapo.data import load_tokenizer
    from slapo.data.sft_loader import make_sft_data
    from slapo.train.assemble import _new_model

    data = make_sft_data(cfg.data, cfg.sft, cfg.seq_len, load_tokenizer(cfg.tokenizer),
                         cfg.seed, cfg.val_fraction)
    torch.manual_seed(cfg.seed)
    model = _new_model(cfg, None, data)
    batch = data.train.next_batch(cfg.batch_size)
    with torch.no_grad():
        return model(**batch, use_cache=False).loss.item(), batch


@pytest.mark.parametrize("layout", ["pack", "pad"])
def test_sft_run_trains_on_the_loaders_rows_with_the_cache_off(tmp_path, layout, one_thread):
    from slapo.train import TrainConfig, train

    cfg = TrainConfig(**TRAIN, data=write_rows(tmp_path / "rows.jsonl"), sft=layout)
    losses = train(cfg)["losses"]
    want, batch = _first_batch_loss(cfg)
    assert losses[0] == pytest.approx(want, rel=1e-5), (losses, want)
    assert (batch["labels"] != -100).any() and (batch["labels"] == -100).any()
    if layout == "pack":  # several documents per row, positions restarting at each
        starts = (batch["position_ids"] == 0).sum(1)
        assert "attention_mask" not in batch and (starts >= 3).all(), starts
    else:
        assert "position_ids" not in batch and (batch["attention_mask"] == 0).any()


def test_sft_labels_are_the_responses_only(tmp_path):
    from slapo.data import load_tokenizer
    from slapo.data.sft_loader import make_sft_data

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "ab", "response": "cd"}) + "\n" +
                    json.dumps({"prompt": "efg", "response": "h"}) + "\n")
    data = make_sft_data(str(path), "pad", 8, load_tokenizer(None), 0, 0.0)
    tok = load_tokenizer(None)
    labelled = [bytes(r[r != -100][:-1].tolist()).decode() for r in data.train.table["labels"]]
    assert sorted(labelled) == ["cd", "h"]  # each response (and its EOS), no prompt byte
    assert all(int(r[r != -100][-1]) == tok.eos_id for r in data.train.table["labels"])


def test_sft_run_resumes_the_same_rows(tmp_path, one_thread):
    from slapo.train import TrainConfig, train

    data = write_rows(tmp_path / "rows.jsonl")
    whole = train(TrainConfig(**{**TRAIN, "steps": 4}, data=data, sft="pack",
                              out=str(tmp_path / "a"), save_every=2))["losses"]
    step2 = tmp_path / "a" / "checkpoints" / "step_000002"
    resumed = train(TrainConfig(**{**TRAIN, "steps": 4}, data=data, sft="pack",
                                out=str(tmp_path / "b"), resume=str(step2)))["losses"]
    assert resumed[-2:] == whole[-2:], (whole, resumed)


def job_sft_tp(data: str) -> list[float]:
    from slapo.train import TrainConfig, train

    torch.set_num_threads(1)
    return train(TrainConfig(**TRAIN, data=data, sft="pack", tp=2))["losses"]


@pytest.mark.dist
def test_sft_pack_under_tp2_trains_like_one_process(dist2, tmp_path):
    from slapo.train import TrainConfig, train

    data = write_rows(tmp_path / "rows.jsonl")
    ranks = dist2.run(job_sft_tp, data)
    one = train(TrainConfig(**TRAIN, data=data, sft="pack"))["losses"]
    assert ranks[0] == ranks[1]
    assert ranks[0] == pytest.approx(one, rel=1e-5, abs=1e-6), (ranks[0], one)


@pytest.mark.parametrize("options, match", [
    ({"sft": "pack", "data": None}, "--sft needs --data"),
    ({"sft": "zip"}, "--sft must be one of pack, pad"),
    ({"sft": "pack", "model": "opt"}, "use --sft pad"),
    ({"sft": "pad", "model": "bert"}, "task is 'masked'"),
])
def test_bad_sft_options_are_refused(tmp_path, options, match, one_thread):
    from slapo.train import TrainConfig, train

    data = write_rows(tmp_path / "rows.jsonl")
    with pytest.raises((ValueError, SystemExit)) as err:
        train(TrainConfig(**{**TRAIN, "data": data, **options}))
    assert match in str(err.value), err.value
    assert not (tmp_path / "runs").exists()


def test_rows_that_are_not_sft_rows_are_refused(tmp_path, one_thread):
    from slapo.data import InputError
    from slapo.train import TrainConfig, train

    path = tmp_path / "text.jsonl"
    path.write_text(json.dumps({"text": "plain text, no prompt"}) + "\n")
    with pytest.raises(InputError, match="text.jsonl"):
        train(TrainConfig(**TRAIN, data=str(path), sft="pad"))


def test_chat_rows_train_with_the_tokenizers_template(tmp_path, one_thread):
    """`--data chat.jsonl --tokenizer DIR --sft pack`: chat `messages` rendered with the
    tokenizer's own template; the run's first loss is the model's on the first rows drawn."""
    from test_sft_data import CHAT, CHATML, word_tokenizer

    from slapo.train import TrainConfig, train

    tok = word_tokenizer(tmp_path / "tok", CHATML)
    rows = [{"messages": CHAT[:3 + 2 * (i % 2)]} for i in range(16)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = TrainConfig(**{**TRAIN, "seq_len": 64}, data=str(path), tokenizer=str(tok), sft="pack")
    losses = train(cfg)["losses"]
    want, batch = _first_batch_loss(cfg)
    assert losses[0] == pytest.approx(want, rel=1e-5), (losses, want)
    assert (batch["position_ids"] == 0).sum(1).min() >= 3  # several chats per row


def test_epochs_sets_the_steps_from_the_rows(tmp_path, one_thread, capsys):
    """`--epochs 2` with 18 train rows (24, 6 held out) of batch 4: ceil(2 x 18 / 4) = 9 steps,
    printed with the samples and steps per epoch."""
    from slapo.train import TrainConfig, train

    cfg = TrainConfig(**{**TRAIN, "steps": 50}, data=write_rows(tmp_path / "rows.jsonl"),
                      sft="pad", val_fraction=0.25, epochs=2)
    assert len(train(cfg)["losses"]) == 9
    assert "18 samples per epoch, 5 steps per epoch; --epochs 2: 9 steps" in capsys.readouterr().out


def test_keep_best_keeps_the_lowest_val_loss_checkpoint(tmp_path, one_thread):
    """`--keep-best --keep-last 1 --save-every 1`: every save is evaluated; the newest
    checkpoint and the one of the lowest val loss survive, and best.json names it. A high
    learning rate makes the val loss rise after a few steps, so the best is not the last."""
    from slapo.train import TrainConfig, train
    from slapo.train.checkpoints import candidates, step_of

    out = tmp_path / "run"
    metrics = train(TrainConfig(**{**TRAIN, "steps": 6, "lr": 0.3, "eval_batches": 1},
                                data=write_rows(tmp_path / "rows.jsonl"), sft="pad",
                                val_fraction=0.25, out=str(out), save_every=1, keep_last=1,
                                keep_best=True))
    evals = {e["step"]: e["val_loss"] for e in metrics["evals"]}
    assert sorted(evals) == list(range(1, 7))  # evaluated at every save
    best = min(evals, key=lambda s: (evals[s], s))
    kept = sorted(step_of(p) for p in candidates(out))
    assert kept == sorted({best, 6}), (kept, best, evals)
    note = json.loads((out / "best.json").read_text())
    assert note["step"] == best and note["val_loss"] == evals[best]
    assert best != 6, evals  # the case the option exists for


def test_fine_tuning_defaults_of_the_learning_rate(tmp_path):
    """`--lr` unset: 1e-3 from an init (a registry model, a config without weights), 2e-5
    fine-tuning a pretrained directory, 2e-4 with LoRA; given, it is kept."""
    from test_train_lora import save_base

    from slapo.train import TrainConfig

    base = save_base(tmp_path / "base")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((tmp_path / "base" / "config.json").read_text())

    def lr(**options) -> float:
        cfg = TrainConfig(**options)
        cfg.check()  # touches no file: the default is asked when the run is built
        return cfg.peak_lr()

    assert lr(model="llama") == 1e-3
    assert lr(model=str(tmp_path / "bare")) == 1e-3
    assert lr(model=base) == 2e-5
    assert lr(model=base, lora_r=4) == 2e-4
    assert lr(model=base, lr=5e-4) == 5e-4


def test_slapo_eval_of_an_sft_run_gives_its_logged_val_loss(tmp_path, one_thread, capsys):
    """`slapo train --sft pad` logs its val loss on the held-out rows; `slapo eval RUN` gives
    the same number (the run's --sft comes with its config), and `--sft` on the eval command
    line is checked like train's."""
    from slapo.cli import main

    run, rows = tmp_path / "run", write_rows(tmp_path / "rows.jsonl")
    assert main(["train", "--model", "llama", "--hidden-size", "32", "--num-layers", "2",
                 "--num-heads", "4", "--seq-len", "128", "--batch-size", "4", "--steps", "2",
                 "--data", rows, "--sft", "pad", "--val-fraction", "0.25", "--eval-batches",
                 "1", "--no-progress", "--no-plot", "--out", str(run)]) == 0
    logged = json.loads((run / "metrics.json").read_text())["val_loss"]
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    assert f"{logged:.4f}" in capsys.readouterr().out
    assert main(["eval", str(run), "--sft", "zip"]) == 2
    assert "--sft must be one of pack, pad" in capsys.readouterr().err
