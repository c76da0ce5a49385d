"""`verst export --out` never deletes what verst did not write (#25 item 1): a non-empty folder
that is not an earlier export, the run directory itself and a folder holding it (`.`) are
refused with exit 2 and left as they were; an earlier export is replaced atomically (kept
whole if writing the new one fails). The run directory is a real checkpoint layout holding a
tiny saved model (built from config, nothing downloads)."""

from __future__ import annotations

import json
import shutil

import pytest

from verst.trainer.cli import main


@pytest.fixture
def run_dir(tmp_path, tiny_checkpoint):
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_2"
    shutil.copytree(tiny_checkpoint, ckpt / "model")
    (ckpt / "meta.json").write_text(json.dumps({"step": 2}))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def _refused(capsys, run_dir, out, needle):
    code = main(["export", str(run_dir), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--out" in err and needle in err, err
    assert "Traceback" not in err


def test_a_non_empty_folder_verst_did_not_write_is_refused_and_kept(run_dir, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    _refused(capsys, run_dir, out, "not an earlier export")
    assert (out / "notes.txt").read_text() == "precious" and _tree(out) == ["notes.txt"]


def test_the_run_itself_and_a_folder_holding_it_are_refused(run_dir, tmp_path, capsys, monkeypatch):
    before = _tree(run_dir)
    _refused(capsys, run_dir, run_dir, "is the run directory")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "work.py").write_text("x = 1")
    _refused(capsys, run_dir, ".", "holds the run directory")
    assert _tree(run_dir) == before and (tmp_path / "work.py").is_file()
    _refused(capsys, run_dir, run_dir / "checkpoints" / "step_2" / "model" / "x", "inside the checkpoint")


def test_new_empty_and_earlier_exports_are_written_and_replaced_whole(run_dir, tmp_path, capsys):
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and (out / ".verst-export.json").is_file()
    (out / "stale.bin").write_text("from the earlier export")
    assert main(["export", str(run_dir), "--out", str(out)]) == 0  # an earlier export: replaced
    assert (out / "config.json").is_file() and not (out / "stale.bin").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["export", str(run_dir), "--out", str(empty)]) == 0
    assert (empty / "config.json").is_file()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # still a model directory Hugging Face loads
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folders left


def test_a_failed_export_keeps_the_earlier_one(run_dir, tmp_path, monkeypatch):
    """A fault in the middle of writing (a simulated full disk) leaves the earlier export whole."""
    from verst.trainer.run import export as export_module

    out = tmp_path / "export"
    export_module.export_run(run_dir, out)
    (out / "earlier.txt").write_text("only the earlier export has this")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    real = shutil.copytree

    def full_disk(src, dst, *a, **k):
        real(src, dst, *a, **k)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_module.shutil, "copytree", full_disk)
    with pytest.raises(OSError, match="No space left"):
        export_module.export_run(run_dir, out)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
