"""The sequence-classification reward model: a tiny real Llama classifier saved to disk and
loaded by path through the registry; a batch scores what one-by-one scoring does."""

from __future__ import annotations

import asyncio

import pytest
import torch

from verst.rollout.config import RolloutConfig
from verst.rollout.rewards import build_reward_fns
from verst.rollout.rewards.reward_model import RewardModelError, RewardModelReward
from verst.rollout.sample import Sample
from verst.rollout.toy import decoder_fields, save_with_char_tokenizer


def _classifier(vocab_size, num_labels=1, **ids):
    from transformers import GenerationConfig, LlamaConfig, LlamaForSequenceClassification

    fields = decoder_fields(vocab_size, **ids)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(
        LlamaConfig(**fields, intermediate_size=2 * fields["hidden_size"], num_labels=num_labels)
    )
    model.generation_config = GenerationConfig()  # save_with_char_tokenizer sets its pad id
    return model


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    torch.set_num_threads(1)
    return str(save_with_char_tokenizer(tmp_path_factory.mktemp("rm") / "rm", _classifier))


SAMPLES = [Sample(prompt=f"{i}*3=", response=str(3 * i) * (1 + i % 3)) for i in range(5)]


async def test_batched_scores_equal_one_by_one(rm_path):
    cfg = RolloutConfig(reward={"type": "reward_model", "reward_model": {"path": rm_path, "batch_size": 8}})
    batched, _ = build_reward_fns(cfg)
    together = await asyncio.gather(*(batched(s) for s in SAMPLES))
    single = RewardModelReward(cfg.reward.reward_model.model_copy(update={"batch_size": 1}))
    one_by_one = [await single(s) for s in SAMPLES]
    assert batched.batches == 1 and single.batches == 5
    assert together == pytest.approx(one_by_one, abs=1e-5) and len(set(one_by_one)) == 5


async def test_two_labels_without_label_index_is_a_reward_error(rm_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_path)
    model = _classifier(len(tok), num_labels=2, pad_token_id=tok.pad_token_id)
    cfg = RolloutConfig(
        reward={"type": "reward_model", "reward_model": {"path": rm_path}}
    ).reward.reward_model
    rm = RewardModelReward(cfg, model=model, tokenizer=tok)
    with pytest.raises(RewardModelError, match="label_index"):
        await rm(SAMPLES[0])
    rm.config = cfg.model_copy(update={"label_index": 1})
    assert 0.0 < await rm(SAMPLES[0]) < 1.0
