"""PromptDataSource: file formats, malformed rows, epochs, returned groups, exact resume."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verst.rollout.config import DataConfig, EvalConfig, EvalDatasetConfig
from verst.rollout.data import PromptDataSource, load_prompt_samples
from verst.rollout.data_sources import build_eval_sets
from verst.rollout.errors import DataError
from verst.rollout.sample import Sample, Status


def _rows(n: int) -> list[dict]:
    return [{"prompt": f"p{i}", "label": str(i), "metadata": {"idx": i}} for i in range(n)]


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture(params=["jsonl", "parquet"])
def data_file(request, tmp_path):
    rows = _rows(7)
    if request.param == "jsonl":
        return _write_jsonl(tmp_path / "d.jsonl", rows)
    return _write_parquet(tmp_path / "d.parquet", rows)


def test_reads_prompt_label_metadata(data_file):
    samples = load_prompt_samples(DataConfig(path=data_file, shuffle=False))
    assert [s.prompt for s in samples] == [f"p{i}" for i in range(7)]
    assert [s.label for s in samples] == [str(i) for i in range(7)]
    assert [s.metadata for s in samples] == [{"idx": i} for i in range(7)]
    assert all(s.status is Status.PENDING and s.tokens == [] for s in samples)


def test_configurable_keys_and_chat_messages(tmp_path):
    rows = [
        {"question": [{"role": "user", "content": "hi"}], "answer": 3, "info": {"src": "a"}},
        {"question": "plain", "answer": None},
    ]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = DataConfig(path=path, input_key="question", label_key="answer", metadata_key="info", shuffle=False)
    a, b = load_prompt_samples(cfg)
    assert a.prompt == [{"role": "user", "content": "hi"}] and a.label == 3 and a.metadata == {"src": "a"}
    assert b.prompt == "plain" and b.label is None and b.metadata == {}


def test_chat_template_rendered_with_tokenizer(tmp_path):
    from verst.rollout.toy import build_char_tokenizer

    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "12+3="}])
    cfg = DataConfig(path=path, apply_chat_template=True)
    (s,) = load_prompt_samples(cfg, tokenizer=build_char_tokenizer())
    assert s.prompt == "12+3="  # the toy template renders a user turn as its content


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"prompt": "a"', "invalid JSON"),
        ('["prompt"]', "not an object"),
        ('{"text": "a"}', "no 'prompt' key"),
        ('{"prompt": 5}', "is a int"),
        ('{"prompt": [{"role": "user"}]}', "not chat messages"),
        ('{"prompt": "a", "metadata": [1]}', "'metadata' is a list"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, line, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n\n{"prompt": "ok2"}\n' + line + "\n")
    with pytest.raises(DataError) as info:
        load_prompt_samples(DataConfig(path=str(path)))
    msg = str(info.value)
    assert f"{path}:4:" in msg and needle in msg and "fix" in msg


def test_malformed_parquet_row_names_row(tmp_path):
    path = _write_parquet(tmp_path / "bad.parquet", [{"prompt": "a"}, {"prompt": None}])
    with pytest.raises(DataError, match=r"bad\.parquet:row 2: 'prompt' is a NoneType"):
        load_prompt_samples(DataConfig(path=path))


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_prompt_samples(DataConfig(path=str(tmp_path / "nope.jsonl")))
    (tmp_path / "d.csv").write_text("prompt\n")
    with pytest.raises(DataError, match=r"unknown file type '\.csv'"):
        load_prompt_samples(DataConfig(path=str(tmp_path / "d.csv")))


def test_groups_are_independent_clones(data_file):
    src = PromptDataSource(DataConfig(path=data_file), n_samples_per_prompt=3)
    (group,) = src.get_samples(1)
    assert len(group) == 3 and len({id(s) for s in group}) == 3
    group[0].metadata["x"] = 1
    assert "x" not in group[1].metadata


def test_epochs_visit_every_prompt_with_their_own_order(data_file):
    src = PromptDataSource(DataConfig(path=data_file, seed=3), n_samples_per_prompt=1)
    epoch0 = [g[0].prompt for g in src.get_samples(7)]
    epoch1 = [g[0].prompt for g in src.get_samples(7)]
    assert sorted(epoch0) == sorted(epoch1) == sorted(f"p{i}" for i in range(7))
    assert epoch0 != epoch1 and src.epoch == 1


def test_no_shuffle_is_file_order(data_file):
    src = PromptDataSource(DataConfig(path=data_file, shuffle=False), n_samples_per_prompt=1)
    assert [g[0].prompt for g in src.get_samples(9)] == [f"p{i}" for i in (*range(7), 0, 1)]


def test_returned_groups_served_first_and_kept_as_is(data_file):
    src = PromptDataSource(DataConfig(path=data_file), n_samples_per_prompt=2)
    first = src.get_samples(3)
    partial = first[1]
    partial[0].tokens, partial[0].response_length, partial[0].status = [1, 2, 3], 1, Status.ABORTED
    src.add_samples([partial, first[2]])
    again = src.get_samples(3)
    assert again[0] == partial and again[1] == first[2]
    assert again[0][0].tokens == [1, 2, 3]
    assert again[2][0].prompt not in {g[0].prompt for g in first}


def _drive(src: PromptDataSource, steps: int, batch: int, returns: int) -> list[list[str]]:
    """Each step takes `batch` groups and hands the last `returns` of them back (like aborts)."""
    seen = []
    for _ in range(steps):
        groups = src.get_samples(batch)
        seen.append([f"{g[0].prompt}|{g[0].metadata.get('resumed', 0)}" for g in groups])
        back = groups[batch - returns :] if returns else []
        for g in back:
            for s in g:
                s.metadata["resumed"] = s.metadata.get("resumed", 0) + 1
                s.status = Status.ABORTED
        src.add_samples(back)
    return seen


def _resume_equivalence(path: str, n_prompts: int, batch: int, returns: int, steps: int, n: int) -> None:
    cfg = DataConfig(path=path, seed=11)
    straight = _drive(PromptDataSource(cfg, n), steps, batch, returns)

    first = PromptDataSource(cfg, n)
    part1 = _drive(first, steps // 2, batch, returns)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint would hold
    resumed = PromptDataSource(cfg, n)
    resumed.load_state_dict(state)
    part2 = _drive(resumed, steps - steps // 2, batch, returns)
    assert part1 + part2 == straight


def test_resume_equivalence_across_epochs_with_returns(data_file):
    # 7 prompts, 3 groups a step with 1 returned: 10 steps cross several epoch boundaries.
    _resume_equivalence(data_file, 7, batch=3, returns=1, steps=10, n=2)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n_prompts=st.integers(1, 9),
    batch=st.integers(1, 6),
    data=st.data(),
)
def test_resume_equivalence_property(tmp_path_factory, n_prompts, batch, data):
    returns = data.draw(st.integers(0, batch - 1))
    steps = data.draw(st.integers(2, 8))
    path = _write_jsonl(tmp_path_factory.mktemp("d") / "d.jsonl", _rows(n_prompts))
    _resume_equivalence(path, n_prompts, batch, returns, steps, n=1)


def test_state_refuses_other_dataset(tmp_path):
    a = PromptDataSource(DataConfig(path=_write_jsonl(tmp_path / "a.jsonl", _rows(4))), 1)
    b = PromptDataSource(DataConfig(path=_write_jsonl(tmp_path / "b.jsonl", _rows(5))), 1)
    with pytest.raises(DataError, match="num_prompts"):
        b.load_state_dict(a.state_dict())


def test_buffer_state_round_trips_samples(data_file):
    src = PromptDataSource(DataConfig(path=data_file), 2)
    groups = src.get_samples(2)
    groups[0][0].tokens, groups[0][0].response_length = [5, 6], 1
    groups[0][0].rollout_logprobs = [-0.5]
    src.add_samples(groups[:1])
    state = src.state_dict()
    other = PromptDataSource(DataConfig(path=data_file), 2)
    other.load_state_dict(state)
    assert other.get_samples(1)[0] == groups[0]
    assert isinstance(other.get_samples(1)[0][0], Sample)


def test_build_eval_sets_from_files(tmp_path):
    path = _write_jsonl(tmp_path / "e.jsonl", _rows(3))
    sets = build_eval_sets(EvalConfig(datasets={"held_out": EvalDatasetConfig(path=path)}))
    assert list(sets) == ["held_out"]
    assert [s.prompt for s in sets["held_out"]] == ["p0", "p1", "p2"]


def test_non_utf8_bytes_are_a_data_error_naming_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 16\)"):
        load_prompt_samples(DataConfig(path=str(path)))


def test_empty_eval_file_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    config = EvalConfig(datasets={"held": EvalDatasetConfig(path=str(empty))})
    with pytest.raises(DataError, match=r"empty\.jsonl: eval dataset 'held' has no rows"):
        build_eval_sets(config)


class _CharTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 128 for c in text]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_prompt_longer_than_the_context_is_found_at_read_naming_file_and_line(tmp_path, fmt):
    rows = [{"prompt": "short"}, {"prompt": "x" * 40}]
    write = _write_jsonl if fmt == "jsonl" else _write_parquet
    path = write(tmp_path / f"d.{fmt}", rows)
    where = "d.jsonl:2" if fmt == "jsonl" else "d.parquet:row 2"
    with pytest.raises(DataError, match=rf"{where}: the prompt has 40 tokens and the context holds 32"):
        PromptDataSource(DataConfig(path=path), 2, tokenizer=_CharTokenizer(), max_prompt_tokens=32)
    assert (
        len(PromptDataSource(DataConfig(path=path), 2, tokenizer=_CharTokenizer(), max_prompt_tokens=41)) == 2
    )


@pytest.mark.parametrize(
    ("fmt", "prompt"), [("jsonl", ""), ("jsonl", "   "), ("jsonl", []), ("parquet", ""), ("parquet", " ")]
)
def test_empty_prompt_is_a_data_error_at_read_naming_file_and_line(tmp_path, fmt, prompt):
    """#25 item 6: an empty prompt used to reach the engine ("input_ids is empty", group FAILED)."""
    rows = [{"prompt": "ok"}, {"prompt": prompt}]
    write = _write_jsonl if fmt == "jsonl" else _write_parquet
    path = write(tmp_path / f"d.{fmt}", rows)
    where = "d.jsonl:2" if fmt == "jsonl" else "d.parquet:row 2"
    with pytest.raises(DataError, match=rf"{where}: 'prompt' is empty.*fix"):
        PromptDataSource(DataConfig(path=path), 2)
