"""Final-answer grading for math responses.

`extract_answer` finds the final answer in a response: the last `\\boxed{...}` (nested braces
allowed), else the last "answer is X" / "answer: X", else the last number. `normalize_answer`
removes presentation (`$`, `\\left`/`\\right`, `\\text{}`, units, thousands separators, spacing)
and rewrites `\\frac{a}{b}` / `\\dfrac` / `\\tfrac` as `(a)/(b)`. `answers_match` compares two
answers numerically (as exact fractions) when both parse as numbers, else as normalised strings.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_BOXED = ("\\boxed", "\\fbox")
_ANSWER_IS = re.compile(r"(?:final\s+answer|answer)\s*(?:is|:|=)\s*:?\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|-?\.\d+")
_UNITS = (
    "square units|sq units|units|unit|degrees|degree|dollars|dollar|cents|cent|percent|"
    "inches|inch|feet|foot|ft|miles|mile|mph|meters|meter|metres|metre|cm|mm|km|kg|mg|g|m|"
    "hours|hour|hrs|hr|minutes|minute|mins|min|seconds|second|sec|s|days|day|weeks|week|"
    "years|year|liters|liter|litres|l|ml|pounds|pound|lbs|lb|ounces|oz|people|students|apples"
)
_TRAILING_UNIT = re.compile(rf"^(.*?\d)\s*(?:{_UNITS})(?:\^?\{{?[23]\}}?)?$")
_FRAC = re.compile(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\frac\s*(\d)\s*(\d)")
_TEXT = re.compile(r"\\(?:text|mathrm|textbf|mbox|mathbf)\s*\{([^{}]*)\}")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_VAR_EQ = re.compile(r"^[a-z]\s*=\s*(?!=)")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (nested braces allowed), or None."""
    start = max(text.rfind(b) for b in _BOXED)
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        # `\boxed 5` (no braces): the next token.
        rest = text[start:].split(maxsplit=1)
        return rest[1].split("$")[0].strip() if len(rest) > 1 else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced: no answer


def extract_answer(text: str) -> str | None:
    """The final answer of a response, or None when it states none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if any(b in text for b in _BOXED):
        return None  # a \boxed{ that never closes (e.g. truncated): no final answer
    matches = list(_ANSWER_IS.finditer(text))
    if matches:
        answer = matches[-1].group(1).splitlines()[0].strip()
        answer = re.sub(r"[.\s]+$", "", answer)
        if answer.startswith("$") and answer.count("$") >= 2:
            answer = answer[1 : answer.index("$", 1)]
        if answer:
            return answer.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def normalize_answer(answer: str) -> str:
    """A canonical string for an answer (see the module docstring)."""
    s = answer.strip()
    s = s.replace("\\$", "").replace("$", "")
    s = _TEXT.sub(r"\1", s)
    for old, new in (
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\:", ""),
        ("\\ ", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\circ", ""),
        ("\\%", ""),
        ("%", ""),
        ("\\displaystyle", ""),
    ):
        s = s.replace(old, new)
    s = s.strip().lower()
    s = _VAR_EQ.sub("", s)
    s = _THOUSANDS.sub("", s)
    s = s.rstrip(".").strip()
    unit = _TRAILING_UNIT.match(s)
    if unit:
        s = unit.group(1)
    while True:
        t = _FRAC.sub(r"(\1)/(\2)", s)
        t = _FRAC_SHORT.sub(r"(\1)/(\2)", t)
        if t == s:
            break
        s = t
    s = re.sub(r"\s+", "", s)
    if s.startswith("{") and s.endswith("}") and s.count("{") == 1:
        s = s[1:-1]
    return s


def _parse_number(s: str) -> Fraction | None:
    """An exact value for a normalised answer that is a number or a fraction of numbers."""
    s = re.sub(r"^\(([^()]*)\)$", r"\1", s)
    num, sep, den = s.partition("/")
    try:
        if not sep:
            return Fraction(_strip_parens(num))
        d = Fraction(_strip_parens(den))
        return Fraction(_strip_parens(num)) / d if d != 0 else None
    except (ValueError, ZeroDivisionError):
        return None


def _strip_parens(s: str) -> str:
    while s.startswith("(") and s.endswith(")"):
        s = s[1:-1]
    if not re.fullmatch(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?", s):
        raise ValueError(s)
    return s


def _half_ulp(s: str) -> Fraction | None:
    """Half a unit in the last decimal place of the decimals in `s` (None: no decimal point)."""
    places = [len(m) for m in re.findall(r"\.(\d*)", s)]
    return Fraction(1, 2 * 10 ** max(places)) if places else None


def answers_match(predicted: str, reference: str, *, rel_tol: float = 1e-6) -> bool:
    """True when two answers are equal numerically (both parse) or as normalised strings.

    Numbers written exactly (integers, fractions) must be equal. When a decimal is involved,
    it may be a rounded value: it matches when the difference is within its rounding (half a
    unit in its last place, at least 1e-12 relative) and within `rel_tol` relative error (so 0.3333333 matches 1/3, but
    0.33 does not, and 1000000.5 does not match 1000000).
    """
    a, b = normalize_answer(predicted), normalize_answer(reference)
    x, y = _parse_number(a), _parse_number(b)
    if x is not None and y is not None:
        if x == y:
            return True
        ulps = [u for u in (_half_ulp(a), _half_ulp(b)) if u is not None]
        if not ulps:
            return False
        scale = max(1, abs(y))
        rounding = max(max(ulps), Fraction(1, 10**12) * scale)  # float reprs are not exact roundings
        return abs(x - y) <= min(rounding, Fraction(rel_tol) * scale)
    return a == b


def grade_math(response: str, label: Any) -> float:
    """1.0 when the response's final answer equals the label, else 0.0.

    A label may itself hold `\\boxed{}` or a worked solution: its final answer is used.
    A list/tuple label accepts any of its entries.
    """
    if label is None:
        return 0.0
    if isinstance(label, (list, tuple)):
        return max((grade_math(response, lab) for lab in label), default=0.0)
    predicted = extract_answer(response)
    if predicted is None:
        return 0.0
    reference = str(label)
    if not isinstance(label, (int, float)):
        reference = last_boxed(reference) or reference
    return 1.0 if answers_match(predicted, reference) else 0.0
