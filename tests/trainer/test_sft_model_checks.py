"""`verst sft` checks its paths before loading anything (issue 25, item 18): a missing model
directory, a directory that is no Hugging Face model, or a missing data file is a config error
(exit 2) naming the key, with every problem in one report — not a loader traceback."""

from __future__ import annotations

from verst.trainer.cli import EXIT_USER_ERROR, main


def _config(tmp_path, model: str, data: str):
    path = tmp_path / "sft.toml"
    path.write_text(f'model_path = "{model}"\ndata_path = "{data}"\noutput_dir = "out"\nsteps = 1\n')
    return path


def test_missing_model_and_data_are_one_config_error(tmp_path, capsys):
    cfg = _config(tmp_path, str(tmp_path / "no-such-model"), str(tmp_path / "missing.jsonl"))
    assert main(["sft", str(cfg)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "model_path" in err and "no-such-model" in err and "not found" in err
    assert "data_path" in err and "missing.jsonl" in err
    assert "Traceback" not in err


def test_a_folder_without_config_json_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    cfg = _config(tmp_path, str(tmp_path / "empty"), str(data))
    assert main(["sft", str(cfg)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "model_path" in err and "no config.json" in err


def test_a_good_model_path_passes_the_check(tmp_path, tiny_checkpoint):
    from verst.trainer.train.sft import SftConfig, sft_problems

    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    cfg = SftConfig(model_path=str(tiny_checkpoint), data_path=str(data), output_dir=str(tmp_path / "o"))
    assert sft_problems(cfg) == []
