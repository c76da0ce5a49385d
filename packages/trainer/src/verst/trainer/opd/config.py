"""The `[opd]` config section (on-policy distillation) and its cross-section validation.

```toml
[opd]
enabled = true
coef = 1.0
log_prob_top_k = 0            # 0 = sampled-token OPD (folded into the advantage); k > 0 = top-k KL loss
token_set = "only_teacher"    # only_student | only_teacher | intersection | union | xor
weighting = "student"         # student | teacher | uniform
teacher_key = "teacher"       # sample.metadata key that names a sample's teacher
with_task_reward = true

[opd.teachers.big]
type = "engine"               # scored by an inference engine (embedded, or SGLang / verst serve)
model_path = "runs/teacher/final"

[opd.teachers.remote]
type = "engine"
engine = { type = "sglang", urls = ["http://127.0.0.1:30000"] }

[opd.teachers.local]
type = "trainer"              # loaded in the trainer; all token sets, no extra server
model_path = "runs/teacher/final"
```

Each teacher kind is a config model of its own (`verst.trainer.opd.teachers`, table `TEACHERS`);
the checks below ask a teacher's `capabilities()` and `problems()`, never its type name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from pydantic import Field

from verst.rollout.config import Section
from verst.rollout.errors import Problem
from verst.rollout.protocols import Capability
from verst.trainer.opd.teachers import TeacherConfig, TeacherSection
from verst.trainer.opd.token_sets import (
    STRATEGIES_NEEDING_TEACHER_ON_STUDENT_IDS,
    TOKEN_SET_STRATEGIES,
    WEIGHTINGS,
)


class OpdConfig(Section):
    """On-policy distillation: train the student on its own samples against teacher log-probs."""

    enabled: bool = Field(False, description="Turn on-policy distillation on.")
    coef: float = Field(
        1.0,
        ge=0,
        description=(
            "Weight of the distillation term: sampled-token OPD subtracts coef * (student_logp - "
            "teacher_logp) from each token's advantage; top-k OPD adds coef * KL to the loss."
        ),
    )
    log_prob_top_k: int = Field(
        0,
        ge=0,
        description=(
            "0 = sampled-token OPD (reverse KL on the sampled tokens, in the advantage); k > 0 = "
            "top-k OPD (the KL over a per-position token set from both sides' top-k, in the loss)."
        ),
    )
    token_set: str = Field(
        "only_teacher",
        description=(
            "Top-k OPD: tokens the KL sums over — only_student, only_teacher, intersection, union, xor "
            "(of the student's and the teacher's top-k)."
        ),
    )
    weighting: str = Field(
        "student",
        description=(
            "Top-k OPD: weight of each token — student (p_s: the reverse-KL estimate), teacher (p_t), uniform (1)."
        ),
    )
    topk_tail: bool = Field(
        False,
        description=(
            "Top-k OPD: add a term for the probability mass outside the token set (as one extra token), "
            "so the student's mass cannot drift out of the set."
        ),
    )
    teachers: dict[str, TeacherConfig] = Field(
        default_factory=dict, description="Teachers by name; a sample picks one through teacher_key."
    )
    teacher_key: str = Field(
        "teacher", description="sample.metadata key whose value names the sample's teacher."
    )
    default_teacher: str | None = Field(
        None,
        description="Teacher of samples without teacher_key in their metadata (None = the first teacher listed).",
    )
    with_task_reward: bool = Field(
        True,
        description="True = distillation on top of the task reward's advantages; False = distillation alone.",
    )
    score_concurrency: int = Field(
        32, ge=1, description="Engine teachers: scoring requests in flight at once."
    )

    @property
    def top_k(self) -> bool:
        """True for top-k OPD, False for sampled-token OPD."""
        return self.log_prob_top_k > 0

    def default_teacher_name(self) -> str | None:
        """The teacher of samples that do not name one."""
        return self.default_teacher or next(iter(self.teachers), None)

    def capability_requests(self) -> dict[Capability, str]:
        """The rollout-strategy capabilities this section needs (capability → requesting key)."""
        if not self.enabled:
            return {}
        if self.top_k:
            return {Capability.OPD_TOP_K: "opd.log_prob_top_k"}
        return {Capability.OPD_SAMPLED_TOKEN: "opd.coef"}


def read_vocab_size(model_dir: str | None) -> int | None:
    """`vocab_size` from a model directory's config.json, without loading weights (None if unknown)."""
    if not model_dir:
        return None
    path = Path(model_dir) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    vocab = data.get("vocab_size", (data.get("text_config") or {}).get("vocab_size"))
    return int(vocab) if isinstance(vocab, int) else None


def opd_problems(o: OpdConfig, *, student_model_path: str | None, fsdp: bool) -> list[Problem]:
    """Every problem of the `[opd]` section in the context of the run (empty when OPD is off):
    `student_model_path` is the trained model's directory, `fsdp` whether the trainer shards."""
    if not o.enabled:
        return []
    out: list[Problem] = []
    names = sorted(o.teachers)
    if not o.teachers:
        out.append(
            Problem(
                "opd.teachers",
                "on-policy distillation needs a teacher, and none is configured",
                "add one, e.g. [opd.teachers.big] type = 'engine', model_path = 'PATH' "
                "(or type = 'trainer'), or set opd.enabled = false",
            )
        )
    if o.default_teacher is not None and o.default_teacher not in o.teachers:
        out.append(
            Problem(
                "opd.default_teacher",
                f"{o.default_teacher!r} is not a configured teacher",
                f"use one of {names}, or unset it (= the first teacher)",
            )
        )
    if o.token_set not in TOKEN_SET_STRATEGIES:
        out.append(
            Problem(
                "opd.token_set",
                f"unknown token-set strategy {o.token_set!r}",
                f"use one of {sorted(TOKEN_SET_STRATEGIES)}",
            )
        )
    if o.weighting not in WEIGHTINGS:
        out.append(
            Problem("opd.weighting", f"unknown weighting {o.weighting!r}", f"use one of {sorted(WEIGHTINGS)}")
        )
    if o.coef == 0 and not o.with_task_reward:
        out.append(
            Problem(
                "opd.coef",
                "coef = 0 with with_task_reward = false leaves nothing to train on",
                "set opd.coef > 0, or opd.with_task_reward = true",
            )
        )
    student_vocab = read_vocab_size(student_model_path)
    if o.top_k and student_vocab is not None and o.log_prob_top_k > student_vocab:
        out.append(
            Problem(
                "opd.log_prob_top_k",
                f"k = {o.log_prob_top_k} exceeds the student's vocabulary of {student_vocab} tokens",
                f"choose 1 <= k <= {student_vocab} (typical: 8-64), or 0 for sampled-token OPD",
            )
        )
    for name, t in o.teachers.items():
        out += _teacher_problems(f"opd.teachers.{name}", t, o, student_vocab, fsdp=fsdp)
    return out


def _teacher_problems(
    key: str, t: TeacherSection, o: OpdConfig, student_vocab: int | None, *, fsdp: bool
) -> list[Problem]:
    """The teacher's own problems, and what its capabilities cannot do in this run."""
    name = key.rsplit(".", 1)[-1]
    can = t.capabilities()
    out = t.problems(key)
    if fsdp and not can.with_fsdp:
        out.append(
            Problem(
                f"{key}.type",
                f"{t.type!r} teachers are not sharded: with train.fsdp each rank would need the whole "
                "teacher and run it on a different number of micro-batches",
                f"serve the teacher instead ({key}.type = 'engine'), or set train.fsdp = false",
            )
        )
    if o.top_k and o.token_set in STRATEGIES_NEEDING_TEACHER_ON_STUDENT_IDS and not can.scores_student_ids:
        out.append(
            Problem(
                "opd.token_set",
                f"token set {o.token_set!r} holds the student's top-k tokens, so the teacher must score "
                f"the student's ids at every position, which {t.type!r} teacher {name!r} "
                "scores only before the trainer knows them",
                f"set {key}.type = 'trainer' (the teacher runs in the trainer), or use "
                "opd.token_set = 'only_teacher' or 'intersection'",
            )
        )
    teacher_vocab = read_vocab_size(t.model_dir())
    if teacher_vocab is not None and student_vocab is not None and teacher_vocab != student_vocab:
        out.append(
            Problem(
                key,
                f"the teacher's vocabulary ({teacher_vocab}) differs from the student's ({student_vocab})",
                "distil between models that share a tokenizer",
            )
        )
    if o.top_k and teacher_vocab is not None and o.log_prob_top_k > teacher_vocab:
        out.append(
            Problem(
                "opd.log_prob_top_k",
                f"k = {o.log_prob_top_k} exceeds teacher {name!r}'s vocabulary of {teacher_vocab}",
                f"choose k <= {teacher_vocab}",
            )
        )
    return out


def opd_capability_requests(opd: OpdConfig) -> Mapping[Capability, str]:
    """Alias of `OpdConfig.capability_requests` for `validate_rollout_config(extra_requests=...)`."""
    return opd.capability_requests()
