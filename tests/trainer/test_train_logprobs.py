"""The trainer's log-probs of a generated batch equal the embedded engine's (train/inference mismatch)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.sample import Sample, Status
from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.config import TrainConfig
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.logprobs import pack_sequences
from verst.trainer.train.side import TrainSide


async def _generate(engine: EmbeddedEngine, temperature: float) -> list[list[Sample]]:
    tok = engine.tokenizer
    groups = []
    for g, prompt in enumerate(["12+3=", "45+67=", "9=", "(1)"]):
        ids = tok(prompt)["input_ids"]
        params = [
            SamplingParams(max_new_tokens=10, temperature=temperature, sampling_seed=10 * g + j)
            for j in range(3)
        ]
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(ids, p)) for p in params))
        groups.append(
            [
                Sample(
                    prompt=prompt,
                    tokens=ids + o.output_ids,
                    response_length=len(o.output_ids),
                    rollout_logprobs=o.output_logprobs,
                    status=Status.COMPLETED if o.finish_reason == "stop" else Status.TRUNCATED,
                    reward=float(j),
                    weight_versions=[o.weight_version],
                    group_index=g,
                    sample_index=3 * g + j,
                )
                for j, o in enumerate(outs)
            ]
        )
    return groups


@pytest.fixture(scope="module")
def generated(tiny_checkpoint):
    torch.set_num_threads(1)
    engine = EmbeddedEngine.from_pretrained(tiny_checkpoint)
    try:
        yield {t: asyncio.run(_generate(engine, t)) for t in (1.0, 0.7)}
    finally:
        asyncio.run(engine.close())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("backend", "packing"), [("auto", True), ("auto", False), ("naive", True)])
def test_trainer_logprobs_match_engine_at_step0(tiny_checkpoint, generated, temperature, backend, packing):
    batch = build_train_batch(generated[temperature])
    assert batch.has_rollout_logprobs and batch.num_samples == 12
    cfg = TrainConfig(
        model_path=str(tiny_checkpoint), micro_batch_size=5, logprob_backend=backend, packing=packing
    )
    side = TrainSide(
        cfg,
        AlgorithmConfig(),
        model_path=str(tiny_checkpoint),
        total_steps=1,
        max_response_len=10,
        temperature=temperature,
        env={},
    )
    ours = side.compute_old_logprobs(batch)  # [B, R]
    diff = (ours - batch.rollout_logprobs).abs() * batch.loss_mask
    mean = float(diff.sum() / batch.loss_mask.sum())
    assert float(diff.max()) < 1e-4, (
        f"max |trainer - engine| = {float(diff.max())} at {divmod(int(diff.argmax()), diff.shape[1])}"
    )
    assert mean < 1e-5
    # the step reports the same mismatch as a metric
    metrics = side.train_step(batch)
    assert metrics["train/logprob_mismatch"] == pytest.approx(mean, abs=1e-6)
    assert metrics["train/logprob_mismatch_max"] < 1e-4
    for key in ("train/entropy", "train/clip_frac", "train/grad_norm", "train/lr", "train/loss"):
        assert key in metrics


def test_packed_equals_padded_layout():
    seqs = [[5, 6, 7, 8, 9], [4, 3], [7, 7, 7, 1]]
    packed = pack_sequences(seqs, [2, 1, 3], packing=True)
    padded = pack_sequences(seqs, [2, 1, 3], packing=False)
    assert packed.input_ids.shape == (1, 11) and padded.input_ids.shape == (3, 5)
    assert packed.target_ids.tolist() == padded.target_ids.tolist() == [8, 9, 3, 7, 7, 1]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3]]
    # positions predicting the targets: seq0 pos 2,3; seq1 pos 0; seq2 pos 0,1,2
    assert packed.gather_index.tolist() == [2, 3, 5, 7, 8, 9]
    assert padded.gather_index.tolist() == [2, 3, 5, 10, 11, 12]
