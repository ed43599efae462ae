"""Training data larger than memory: `slapo prepare-data` writes memory-mapped token files that
`slapo train --data DIR` maps (slapo/data/prepared.py, docs/train.md "Large corpora").

The reference is the in-memory path (`make_data` / `slapo train --data SPEC`): a prepared
directory must hold exactly its token streams (same split, packing and fingerprint) and train
to bit-identical losses, on 1 and 2 ranks; the loader must map the file, not copy it.
Everything is built here, offline: a small BPE tokenizer, word-level tokenizers with wide
vocabularies (ids past 2**15 and past 2**16), text, JSONL and `save_to_disk` inputs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from user_data import bpe_tokenizer, user_files

from slapo.cli import main
from slapo.data import InputError, load_corpus, make_data, open_prepared, prepare, sources
from slapo.data import prepare_tokens as prepared_mod

TINY = ["--hidden-size", "32", "--num-layers", "2", "--num-heads", "2", "--seq-len", "32",
        "--batch-size", "4", "--no-progress", "--no-plot", "--eval-batches", "1"]

pytestmark = pytest.mark.usefixtures("one_thread")


def quiet(*args, **kwargs) -> None:
    pass


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A 300-token BPE tokenizer (two corpus files), saved like any HF tokenizer."""
    texts = load_corpus()
    return bpe_tokenizer(tmp_path_factory.mktemp("tok"),
                         [texts["essays.txt"], texts["poems.txt"]], 300)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    """The corpus as the user's files: three .txt files and a .jsonl of paragraphs."""
    return user_files(tmp_path_factory.mktemp("text"),
                      ("essays.txt", "poems.txt", "aesop_fables.txt"))


def same_streams(prepared_dir: Path, data, tokenizer=None) -> dict:
    """The prepared directory holds exactly `data`'s (make_data's) streams; its meta."""
    p = open_prepared(prepared_dir, data.tokenizer)
    assert torch.equal(p.train[:], data.train.tokens.long())
    assert torch.equal(p.val[:], data.val_tokens.long())
    assert p.fingerprint("train") == data.train.fingerprint  # the loader's own hash, in memory
    return p.meta


# ---- the prepared streams are make_data's ------------------------------------------------------
def test_text_files_equal_in_memory(tok_dir, text_dir, tmp_path):
    spec = str(text_dir / "*.txt")
    meta = prepare(spec, tmp_path / "p", str(tok_dir), val_fraction=0.1, log=quiet)
    data = make_data("causal", 32, 0, data=spec, tokenizer=str(tok_dir), val_fraction=0.1)
    assert same_streams(tmp_path / "p", data) == meta
    assert meta["dtype"] == "uint16" and meta["split"]["rule"] == "tail"
    assert meta["tokenizer"]["name"] == str(tok_dir) and meta["tokenizer"]["vocab_size"] == 300
    assert meta["source"] == {"data": spec, "text_field": "text", "documents": 3,
                              "piece_chars": sources.PIECE_CHARS}
    size = (tmp_path / "p" / "train.bin").stat().st_size
    assert size == 2 * meta["files"]["train"]["tokens"] == meta["files"]["train"]["bytes"]
    raw = np.fromfile(tmp_path / "p" / "train.bin", dtype="<u2")  # nanoGPT reads it as is
    assert torch.equal(torch.from_numpy(raw.astype(np.int64)), data.train.tokens.long())


def test_flags_a_prepared_dir_ignores_are_warned(tok_dir, text_dir, tmp_path):
    """The split is fixed when preparing: asking another one warns (naming the flag and the
    prepared value); asking the prepared one is silent."""
    import warnings

    spec = str(text_dir / "*.txt")
    prepare(spec, tmp_path / "p", str(tok_dir), val_fraction=0.05, log=quiet)
    for silent in (0.05, 0.1):  # the prepared value, and the default (not asked for)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            make_data("causal", 32, 0, data=str(tmp_path / "p"), tokenizer=str(tok_dir),
                      val_fraction=silent)
    with pytest.warns(UserWarning, match=r"--val-fraction 0\.2 is ignored.*prepared with 0\.05"):
        make_data("causal", 32, 0, data=str(tmp_path / "p"), tokenizer=str(tok_dir),
                  val_fraction=0.2)


def test_text_directory_with_another_meta_json_stays_text(text_dir, tmp_path):
    """Only a directory with .bin files or a meta.json of this format is a prepared one."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text(load_corpus()["poems.txt"])
    (tmp_path / "notes" / "meta.json").write_text('{"format": "my notes", "author": "me"}')
    data = make_data("causal", 32, 0, data=str(tmp_path / "notes"))
    assert data.train.fingerprint == make_data("causal", 32, 0,
                                               data=str(tmp_path / "notes" / "a.txt")
                                               ).train.fingerprint


@pytest.mark.parametrize("seed,val_fraction", [(0, 0.1), (3, 0.25), (0, 0.0)])
def test_jsonl_and_mixed_record_split_equal_in_memory(tok_dir, text_dir, tmp_path, seed,
                                                      val_fraction):
    """Rows: the same seeded draw over the document count (a text file in the spec is one
    record), each split packed in order."""
    spec = f"{text_dir / 'poems.txt'},{text_dir / 'paras.jsonl'}"
    meta = prepare(spec, tmp_path / "p", str(tok_dir), text_field="body", seed=seed,
                   val_fraction=val_fraction, log=quiet)
    data = make_data("causal", 32, seed, data=spec, text_field="body", tokenizer=str(tok_dir),
                     val_fraction=val_fraction)
    same_streams(tmp_path / "p", data)
    assert meta["split"] == {"rule": "record", "val_fraction": val_fraction, "seed": seed}
    assert (meta["files"]["val"]["tokens"] == 0) == (val_fraction == 0)


def test_saved_dataset_with_its_own_val_split(tok_dir, text_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = sources.read_documents(str(text_dir / "paras.jsonl"), "body").texts
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": rows[:60]}),
                               "validation": datasets.Dataset.from_dict({"text": rows[60:80]})})
    dd.save_to_disk(str(tmp_path / "ds"))
    meta = prepare(str(tmp_path / "ds"), tmp_path / "p", str(tok_dir), log=quiet)
    same_streams(tmp_path / "p", make_data("causal", 32, 0, data=str(tmp_path / "ds"),
                                           tokenizer=str(tok_dir)))
    assert meta["split"]["rule"] == "dataset"
    assert meta["files"]["val"]["documents"] == 20


def test_big_text_file_in_pieces_with_spill(text_dir, tmp_path, monkeypatch):
    """A file larger than a piece is read in pieces and spilled to a scratch file until its
    tail is cut: byte tokens equal the whole-file tokenisation, and memory stays bounded."""
    monkeypatch.setattr(sources, "PIECE_CHARS", 700)
    monkeypatch.setattr(prepared_mod, "PIECE_CHARS", 700)
    monkeypatch.setattr(prepared_mod, "SPILL_TOKENS", 500)
    monkeypatch.setattr(prepared_mod, "FLUSH_TOKENS", 300)
    big = tmp_path / "big.txt"
    text = load_corpus()["essays.txt"]
    big.write_text(text + "one line longer than a piece " * 60 + "\r\nend\r\n", "utf-8")
    spec = f"{big},{text_dir / 'poems.txt'}"
    pieces = list(sources.open_documents(spec).pieces())
    assert len(pieces) > 10 and max(len(t) for _, t, _ in pieces) <= 1400
    prepare(spec, tmp_path / "p", val_fraction=0.2, log=quiet)
    same_streams(tmp_path / "p", make_data("causal", 32, 0, data=spec, val_fraction=0.2))
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["meta.json", "train.bin",
                                                                   "val.bin"]


def word_tokenizer(out: Path, vocab_size: int) -> Path:
    """A word-level tokenizer whose words `w0..w{n-1}` are ids 0..n-1 (ids past 2**15/2**16)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 2)}
    vocab.update({"[UNK]": vocab_size - 2, "[EOS]": vocab_size - 1})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                            eos_token="[EOS]").save_pretrained(out)
    return out


@pytest.mark.parametrize("vocab_size,dtype", [(40_000, "uint16"), (70_000, "uint32")])
def test_wide_vocabularies(tmp_path, vocab_size, dtype):
    """uint16 up to 65536 ids (ids >= 2**15 read back unsigned), uint32 beyond."""
    tok = word_tokenizer(tmp_path / "tok", vocab_size)
    g = torch.Generator().manual_seed(0)
    rows = [" ".join(f"w{int(i)}" for i in torch.randint(vocab_size - 2, (50,), generator=g))
            for _ in range(40)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    spec = str(tmp_path / "rows.jsonl")
    meta = prepare(spec, tmp_path / "p", str(tok), log=quiet)
    data = make_data("causal", 32, 0, data=spec, tokenizer=str(tok))
    same_streams(tmp_path / "p", data)
    assert meta["dtype"] == dtype and int(data.train.tokens.max()) > 2**15


# ---- training on a prepared directory --------------------------------------------------------
def train(out: Path, *flags: str) -> dict:
    assert main(["train", *TINY, "--out", str(out), *flags]) == 0
    return json.loads((out / "metrics.json").read_text())


def test_train_prepared_equals_in_memory_and_resumes(tok_dir, text_dir, tmp_path, capsys):
    """`slapo prepare-data` then `slapo train --data DIR`: bit-identical to `--data SPEC`
    (losses and val loss), and a resumed run continues exactly."""
    spec = f"{text_dir / 'poems.txt'},{text_dir / 'paras.jsonl'}"
    tok = ["--tokenizer", str(tok_dir)]
    assert main(["prepare-data", "--data", spec, "--text-field", "body", "--seed", "2",
                 "--out", str(tmp_path / "p"), *tok]) == 0
    assert "train with: slapo train --data" in capsys.readouterr().out
    flags = [*tok, "--seed", "2", "--steps", "4", "--dropout", "0.1"]
    memory = train(tmp_path / "mem", "--data", spec, "--text-field", "body", *flags)
    mapped = train(tmp_path / "map", "--data", str(tmp_path / "p"), *flags, "--save-every", "2")
    assert mapped["losses"] == memory["losses"] and mapped["val_loss"] == memory["val_loss"]
    assert mapped["train_tokens"] == memory["train_tokens"]
    assert all(math.isfinite(x) for x in mapped["losses"])
    resumed = train(tmp_path / "res", "--data", str(tmp_path / "p"), *flags, "--resume",
                    str(tmp_path / "map" / "checkpoints" / "step_000002"))
    assert resumed["losses"] == mapped["losses"] and resumed["resumed_from"] == 2


def test_tokenizer_mismatch_is_refused(tok_dir, text_dir, tmp_path):
    prepare(str(text_dir / "poems.txt"), tmp_path / "p", str(tok_dir), log=quiet)
    with pytest.raises(InputError, match="pass --tokenizer"):
        make_data("causal", 32, 0, data=str(tmp_path / "p"))  # bytes: not the data's
    other = tmp_path / "tok_copy"
    other.mkdir()
    for f in tok_dir.iterdir():  # a copy of the same tokenizer elsewhere is the same one
        (other / f.name).write_bytes(f.read_bytes())
    make_data("causal", 32, 0, data=str(tmp_path / "p"), tokenizer=str(other))


def job_train(options: dict) -> list[float]:
    """On each of 2 ranks: `slapo train` (DDP over 2 data-parallel ranks); its losses."""
    from slapo.train import TrainConfig, train

    torch.set_num_threads(1)
    return train(TrainConfig(**options))["losses"]


@pytest.mark.dist
def test_two_ranks_map_the_same_files(dist2, tok_dir, text_dir, tmp_path):
    """2 data-parallel ranks each map the prepared files: the same losses as 2 ranks on the
    text in memory."""
    spec = str(text_dir / "*.txt")
    prepare(spec, tmp_path / "p", str(tok_dir), log=quiet)
    options = dict(tokenizer=str(tok_dir), steps=3, seq_len=32, batch_size=4, hidden_size=32,
                   num_layers=2, num_heads=2, progress=False, plot=False, eval_batches=1)
    mapped = dist2.run(job_train, {**options, "data": str(tmp_path / "p")})
    memory = dist2.run(job_train, {**options, "data": spec})
    assert mapped[0] == mapped[1] == memory[0]
    assert all(math.isfinite(x) for x in mapped[0])


# ---- memory: the loader maps the file, it does not copy it -------------------------------------
def _anon_kib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("RssAnon:")))


def _mapping_of(ptr: int) -> str:
    """The file /proc/self/maps shows at address ptr ('' when anonymous)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= ptr < hi:
            return parts[5] if len(parts) > 5 else ""
    return ""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_loader_maps_a_50mb_file_without_copying(tmp_path, monkeypatch):
    """A 50 MB train.bin (25 M uint16 tokens): the loader's tokens live in the file's mapping,
    drawing batches and the run's fingerprint (from meta.json) read no more than they need:
    anonymous memory grows by far less than the file."""
    (tmp_path / "a.txt").write_text("a small text to prepare once\n" * 200)
    prepare(str(tmp_path / "a.txt"), tmp_path / "p", log=quiet)
    tokens = np.random.default_rng(0).integers(0, 259, 25_000_000, dtype=np.uint16)
    tokens.astype("<u2").tofile(tmp_path / "p" / "train.bin")
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    meta["files"]["train"].update(tokens=len(tokens), bytes=2 * len(tokens),
                                  fingerprint="f" * 16)  # stands for the writer's hash
    (tmp_path / "p" / "meta.json").write_text(json.dumps(meta))
    del tokens

    def no_hashing(*args):
        raise AssertionError("the stream was hashed at start (read meta.json instead)")

    from slapo.data import dataset

    monkeypatch.setattr(dataset, "fingerprint", no_hashing)
    before = _anon_kib()
    data = make_data("causal", 256, 0, data=str(tmp_path / "p"))
    for _ in range(20):
        batch = data.train.next_batch(16)
    state = data.train.state_dict()
    grown_mib = (_anon_kib() - before) / 1024
    mapped = data.train.tokens.mapped
    assert _mapping_of(mapped.data_ptr()) == str(tmp_path / "p" / "train.bin")
    assert not mapped.untyped_storage().resizable()
    assert state["fingerprint"] == "f" * 16 and state["num_tokens"] == 25_000_000
    assert batch["input_ids"].shape == (16, 256) and int(batch["input_ids"].max()) < 259
    assert grown_mib < 20, f"{grown_mib:.1f} MiB of anonymous memory for a 48 MiB file"


# ---- writing: atomic, refuses to clobber -----------------------------------------------------
def test_failed_prepare_leaves_nothing(text_dir, tmp_path, monkeypatch):
    """A prepare that dies while writing (here: the tokenizer fails on the second batch)
    leaves neither --out, nor its partial directory, nor the parents it created."""
    from slapo.data.tokenizer import ByteTokenizer

    monkeypatch.setattr(prepared_mod, "BATCH_DOCS", 1)
    calls = []

    def dies(self, texts):
        calls.append(len(texts))
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a killed job
        return [self.encode(t) for t in texts]

    monkeypatch.setattr(ByteTokenizer, "encode_many", dies)
    out = tmp_path / "new" / "deeper" / "p"
    with pytest.raises(KeyboardInterrupt):
        prepare(str(text_dir / "*.txt"), out, log=quiet)
    assert list(tmp_path.iterdir()) == []


def test_out_rules_empty_existing_and_overwrite(text_dir, tmp_path):
    spec = str(text_dir / "poems.txt")
    (tmp_path / "p").mkdir()  # an empty directory is fine
    first = prepare(spec, tmp_path / "p", val_fraction=0.1, log=quiet)
    with pytest.raises(InputError, match="not empty"):
        prepare(spec, tmp_path / "p", val_fraction=0.3, log=quiet)
    assert json.loads((tmp_path / "p" / "meta.json").read_text()) == first
    second = prepare(spec, tmp_path / "p", val_fraction=0.3, overwrite=True, log=quiet)
    assert second["files"]["val"]["tokens"] > first["files"]["val"]["tokens"]
    assert json.loads((tmp_path / "p" / "meta.json").read_text()) == second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]  # no partial or old dir left
