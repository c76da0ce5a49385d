"""PPO with a critic on the real tiny model: the value loss falls on a fixed batch, values and
advantages live only on model tokens (multi-turn: tool tokens masked), critic warm-up holds the
policy, and a resumed run (N/2 steps, checkpoint, new train side, N/2 steps) ends with exactly
the parameters of N straight steps — policy and critic, optimizers and schedules included."""

from __future__ import annotations

import math

import pytest
import torch

from verst.rollout.sample import Sample, Status
from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.config import TrainConfig
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.side import TrainSide

PPO = {"advantage": {"type": "gae", "gamma": 1.0, "lam": 0.95}, "critic": {"lr": 1e-2, "head_init_std": 0.02}}


def _groups(vocab: int, *, tool_tokens: bool = False) -> list[list[Sample]]:
    gen = torch.Generator().manual_seed(7)
    groups = []
    for g in range(2):
        group = []
        for j in range(3):
            p, r = 3, 3 + (g + j) % 3
            tokens = torch.randint(4, vocab, (p + r,), generator=gen).tolist()
            mask = [1] * r
            if tool_tokens:  # a multi-turn sample: the middle response tokens came from a tool
                mask[1 : r - 1] = [0] * (r - 2)
            group.append(
                Sample(
                    prompt=str(g),
                    tokens=tokens,
                    response_length=r,
                    loss_mask=mask,
                    reward=float((j + g) % 2),
                    status=Status.COMPLETED,
                    rollout_logprobs=[-3.0] * r,
                    group_index=g,
                    sample_index=3 * g + j,
                )
            )
        groups.append(group)
    return groups


def _side(ckpt, algo=PPO, **train) -> TrainSide:
    cfg = TrainConfig(
        model_path=str(ckpt), lr=1e-3, micro_batch_size=train.pop("micro_batch_size", 4), **train
    )
    return TrainSide(
        cfg,
        AlgorithmConfig(**algo),
        model_path=str(ckpt),
        total_steps=4,
        max_response_len=6,
        temperature=1.0,
        env={},
    )


def _vocab(side: TrainSide) -> int:
    return side.bundle.hf_model.config.vocab_size


def test_value_loss_falls_on_a_fixed_batch(tiny_checkpoint):
    torch.set_num_threads(1)
    side = _side(tiny_checkpoint, {**PPO, "critic": {"lr": 3e-3, "warmup_steps": 100, "value_clip": None}})
    batch = build_train_batch(_groups(_vocab(side)))
    policy_before = {k: v.clone() for k, v in side.state_dict_for_sync().items()}
    losses = [side.train_step(batch)["train/critic/vf_loss"] for _ in range(8)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.5 * losses[0], losses
    assert side.critic is not None and side.critic.optimizer_steps == 8
    # critic warm-up (100 steps): the policy has not moved
    after = side.state_dict_for_sync()
    assert all(torch.equal(after[k], policy_before[k]) for k in policy_before)
    assert side.optimizer_steps == 0


def test_values_and_advantages_only_on_model_tokens(tiny_checkpoint):
    torch.set_num_threads(1)
    side = _side(tiny_checkpoint)
    batch = build_train_batch(_groups(_vocab(side), tool_tokens=True))
    mask = batch.loss_mask
    assert (mask.sum(-1) == 2).all()  # first and last response token are the model's
    assert side.critic is not None
    values = side.critic.values(batch)
    assert (values[mask == 0] == 0).all() and (values[mask > 0] != 0).any()
    adv, ret = side.algo.compute_advantages_and_returns(batch.rewards, mask, values=values)
    assert ret is not None
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()
    # γ = 1: the first model token's return is the reward plus λ-weighted value of the next model token
    lam = 0.95
    for i in range(batch.num_samples):
        on = torch.nonzero(mask[i]).squeeze(1).tolist()
        r = float(batch.rewards.reshape(-1)[i])
        v0, v1 = float(values[i, on[0]]), float(values[i, on[1]])
        assert float(ret[i, on[1]]) == pytest.approx(r, abs=1e-5)
        assert float(ret[i, on[0]]) == pytest.approx(v1 + lam * (r - v1), abs=1e-5)
        assert v0 != 0
    m = side.train_step(batch)
    assert all(math.isfinite(v) for v in m.values()), m
    assert "train/critic/explained_var" in m and m["train/critic/policy_updated"] == 1.0


def _params(side: TrainSide) -> dict[str, torch.Tensor]:
    assert side.critic is not None
    out = {f"policy/{k}": v.clone() for k, v in side.state_dict_for_sync().items()}
    out.update({f"critic/{k}": v.clone() for k, v in side.critic.inner.state_dict().items()})
    return out


def test_resume_with_a_critic_is_exact(tiny_checkpoint, tmp_path):
    torch.set_num_threads(1)
    algo = {
        **PPO,
        "critic": {
            "lr": 1e-2,
            "warmup_steps": 1,
            "scheduler": "cosine",
            "lr_warmup_steps": 1,
            "head_init_std": 0.02,
        },
    }
    train = {"num_updates_per_rollout": 2, "scheduler": "linear"}
    straight = _side(tiny_checkpoint, algo, **train)
    batch = build_train_batch(_groups(_vocab(straight)))
    for _ in range(4):
        straight.train_step(batch)
    want = _params(straight)

    first = _side(tiny_checkpoint, algo, **train)
    for _ in range(2):
        first.train_step(batch)
    first.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "critic" / "state.pt").is_file()
    resumed = _side(tiny_checkpoint, algo, **train)
    resumed.load(tmp_path / "ckpt")
    assert resumed.critic is not None and resumed.critic.steps == 2
    for _ in range(2):
        m = resumed.train_step(batch)
    got = _params(resumed)
    assert got.keys() == want.keys()
    diff = {k: float((got[k] - want[k]).abs().max()) for k in want}
    assert max(diff.values()) == 0.0, {k: d for k, d in diff.items() if d}
    assert straight.critic is not None
    assert m["train/critic/lr"] == pytest.approx(straight.critic.optimizer.param_groups[0]["lr"])
    assert resumed.critic.optimizer_steps == straight.critic.optimizer_steps == 8
    assert resumed.optimizer_steps == straight.optimizer_steps == 6  # the policy waited one step


def test_loading_a_checkpoint_without_critic_state_says_so(tiny_checkpoint, tmp_path):
    torch.set_num_threads(1)
    plain = _side(tiny_checkpoint, {})
    plain.save(tmp_path / "ckpt")
    with_critic = _side(tiny_checkpoint)
    with pytest.raises(RuntimeError, match="no critic state"):
        with_critic.load(tmp_path / "ckpt")
