"""End-to-end partial-rollout properties on the default path (`generate_and_rm` + `SingleTurnGenerate`).

`test_partial_mask.py` covers the mask arithmetic alone; here a sample is aborted at arbitrary
points across arbitrary rollouts and resumed through the real generate path, and the result is
compared with one uninterrupted generation.
"""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st
from inference_testkit import ByteTokenizer, ListDataSource, ToyEngine, make_context

from verst.rollout.engine import GenerateOutput, GenerateRequest
from verst.rollout.generate import generate_and_rm
from verst.rollout.protocols import GenerateState, RolloutRequest
from verst.rollout.sample import Sample, Status
from verst.rollout.sampling import sampling_params_for
from verst.rollout.strategies.fully_async import FullyAsyncRollout


class PositionalEngine:
    """Token at response position p is a function of p alone, so resuming continues exactly.

    Each request stops after `cuts.pop(0)` tokens with finish `abort` (while cuts remain); it
    reports `version` as its weight version and the log-prob `-p/100` for position p.
    """

    def __init__(self, target: int, cuts: list[int]) -> None:
        self.target = target
        self.cuts = list(cuts)
        self.version = 0
        self.requests: list[GenerateRequest] = []
        self.prompt_len = 0

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.requests.append(request)
        done = len(request.input_ids) - self.prompt_len
        n = min(self.target - done, request.sampling.max_new_tokens)
        finish = "stop" if done + n == self.target else "length"
        if self.cuts:
            cut = self.cuts.pop(0)
            if cut < n:
                n, finish = cut, "abort"
        pos = range(done, done + n)
        return GenerateOutput([70 + p % 40 for p in pos], [-p / 100 for p in pos], finish, self.version)


@settings(max_examples=60, deadline=None)
@given(
    target=st.integers(1, 30),
    max_new=st.integers(1, 30),
    pieces=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 2)), max_size=6),
    mask_offpolicy=st.booleans(),
)
def test_resumed_sample_equals_uninterrupted_generation(target, max_new, pieces, mask_offpolicy):
    """Abort after `cut` tokens, then resume `rollout_gap` rollouts later, repeatedly."""
    cuts = [cut for cut, _ in pieces]
    engine = PositionalEngine(target, cuts)
    ctx = make_context(
        engine,
        max_response_len=max_new,
        partial_rollout=True,
        mask_offpolicy_in_partial_rollout=mask_offpolicy,
    )
    params = sampling_params_for(ctx.config)
    sample = Sample(prompt="abc", sample_index=0, group_index=0)
    engine.prompt_len = len(ByteTokenizer().encode("abc"))
    rollout_id = 0
    piece_rollouts: list[tuple[int, int]] = []  # (rollout id, tokens generated) per request

    async def run() -> None:
        nonlocal rollout_id
        gaps = [gap for _, gap in pieces] + [0] * 40
        for gap in gaps:
            state = GenerateState(ctx, rollout_id, engine.version, asyncio.Semaphore(4))
            before = sample.response_length
            requests_before = len(engine.requests)
            await generate_and_rm(state, sample, params)
            if len(engine.requests) > requests_before:
                piece_rollouts.append((rollout_id, sample.response_length - before))
                req = engine.requests[-1]
                assert req.sampling.max_new_tokens == max_new - before, "max_new_tokens reduced by the prefix"
                assert req.input_ids == sample.tokens[: len(req.input_ids)]
            if sample.status is not Status.ABORTED:
                return
            assert sample.metadata["start_rollout_id"] <= rollout_id
            rollout_id += gap
            engine.version = rollout_id

    asyncio.run(run())
    expect_len = min(target, max_new)
    sample.validate()
    assert sample.status is (Status.COMPLETED if target <= max_new else Status.TRUNCATED)
    assert sample.response_length == expect_len
    assert sample.response_tokens == [70 + p % 40 for p in range(expect_len)], "same as uninterrupted"
    assert sample.rollout_logprobs == [-p / 100 for p in range(expect_len)]
    assert sample.weight_versions == [r for r, _ in piece_rollouts]
    assert sample.reward is not None, "scored once finished"
    mask = sample.effective_loss_mask()
    zeros = mask.count(0)
    assert mask == [0] * zeros + [1] * (expect_len - zeros), "masked tokens form a prefix"
    last_rollout, last_n = piece_rollouts[-1]
    assert zeros <= expect_len - last_n, "tokens of the last piece are always trained on"
    if not mask_offpolicy:
        assert zeros == 0
    else:
        older = sum(n for r, n in piece_rollouts if r < last_rollout)
        assert zeros >= older, "every token from an earlier rollout is masked"


async def test_fully_async_close_then_resume_in_a_later_rollout_masks_the_old_prefix():
    """Partial samples handed back by `close()` resume in the next strategy's rollout, under
    newer weights: the prefix of the old weights is masked (by token version)."""
    engine = ToyEngine(length=lambda r: 30, token_delay_s=0.01)
    ctx = make_context(
        engine,
        fully_async=True,
        async_buffer_groups=4,
        batch_size=1,
        n_samples_per_prompt=2,
        max_response_len=30,
        partial_rollout=True,
        mask_offpolicy_in_partial_rollout=True,
    )
    first = FullyAsyncRollout(ctx)
    first_task = asyncio.create_task(first(RolloutRequest(rollout_id=0)))
    await asyncio.sleep(0.08)
    first_task.cancel()
    await asyncio.gather(first_task, return_exceptions=True)
    await first.close()
    ds: ListDataSource = ctx.data_source
    partial = {id(s): s.response_length for g in ds.buffer for s in g if s.status is Status.ABORTED}
    assert partial and all(0 < n < 30 for n in partial.values())

    engine.token_delay_s = 0.0
    engine.weight_version = 1  # the trainer pushed new weights in between
    second = FullyAsyncRollout(ctx)
    resumed = []
    for rid in (5, 6, 7, 8):
        r = await second(RolloutRequest(rollout_id=rid, weight_version=1))
        resumed += [s for g in r.groups for s in g if id(s) in partial]
    await second.close()
    assert resumed, "the partial samples came back"
    for s in resumed:
        s.validate()
        old = partial[id(s)]
        assert s.response_length == 30
        assert s.effective_loss_mask() == [0] * old + [1] * (30 - old)
        assert s.metadata["start_rollout_id"] == 0
