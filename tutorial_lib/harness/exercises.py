"""Exercises in the lessons: the reader edits a cell, a check cell says whether the answer is right.

A lesson's exercise is two code cells::

    [exercise]          the cell the reader edits: a prediction to fill in (``prediction = None``), or a
                        knob to change with the code that measures its effect. Its metadata holds a
                        reference solution and a wrong answer (a wrong prediction, or a wrong result):
                        {"exercise": {"solution": "<source>", "wrong": "<source>"}}
    [exercise-check]    calls check_answer(...): prints how to start while unanswered, and asserts
      or [self-check]   the answer once there is one; or, for a knob, asserts what must hold for any value

The harness (``tutorial_lib.harness.notebooks.run_lesson``) never leaves an exercise unanswered: it
runs every lesson with the reference solutions in place, so every exercise check must pass, and
right after each check it runs the wrong answer through the same check and requires it to fail
(then restores the solution), so no check can accept anything::

    exercise cell  <- solution           the check prints CHECK PASSED (counted like a self-check)
    + probe cell   exec(wrong); check    must raise SelfCheckError, then exec(solution) again

Example (a check cell)::

    from tutorial_lib.harness.exercises import check_answer
    prediction = 3                  # the exercise cell: the reader's answer (one gather per FSDP group)
    measured_gathers = 2 + 1        # what the lesson counted: 2 blocks + the root, kept gathered for backward
    check_answer(prediction, measured_gathers, "all-gathers per step with reshard_after_forward=False")
"""

from __future__ import annotations

import copy
import json

from tutorial_lib.harness.checks import PASS_MARK, SelfCheckError, check

EXERCISE_TAG = "exercise"
EXERCISE_CHECK_TAG = "exercise-check"
EXERCISE_PROBE_TAG = "exercise-probe"  # the cells with_solutions adds (a wrong answer, its check)
NOT_ATTEMPTED = "EXERCISE NOT ANSWERED YET:"
REJECTS_MARK = f"{PASS_MARK} the exercise check rejects a wrong answer"

__all__ = ["EXERCISE_CHECK_TAG", "EXERCISE_PROBE_TAG", "EXERCISE_TAG", "ExerciseError", "check_answer",
           "raise_if_unchecked", "with_solutions"]


class ExerciseError(ValueError):
    """A lesson's exercise cells are malformed (no solution, no check cell after it, ...)."""


def check_answer(answer, expected, what: str, *, rel_tol: float = 0.0) -> None:
    """The body of an exercise-check cell.

    ``answer is None`` (not answered yet): prints what to do and passes. Otherwise asserts
    ``answer == expected`` (numbers: within ``rel_tol`` relative to ``expected``; a bool only matches a
    bool), with a pass line.
    """
    if answer is None:
        print(f"{NOT_ATTEMPTED} {what} -- edit the cell above, then run it and this one", flush=True)
        return
    if isinstance(answer, bool) != isinstance(expected, bool):  # True is no count, 1 is no yes/no answer
        ok = False
    elif isinstance(expected, (int, float)) and not isinstance(expected, bool) and rel_tol:
        ok = isinstance(answer, (int, float)) and abs(answer - expected) <= rel_tol * abs(expected)
    else:
        ok = answer == expected
    check(ok, f"{what}: your answer {answer!r}" + ("" if ok else f" (measured {expected!r})"))


def _probe_source(wrong: str, check_src: str, solution: str) -> str:
    """A cell that runs the wrong answer through the check, requires it to fail, restores the solution."""
    return "\n".join([
        "# added by the harness: the check above must reject a wrong answer",
        f"from {__name__} import SelfCheckError as _SelfCheckError",
        f"exec({wrong!r})",
        "try:",
        f"    exec({check_src!r})",
        "except _SelfCheckError:",
        f"    print({REJECTS_MARK!r})",
        "else:",
        "    raise AssertionError('the exercise check accepted a wrong answer: it cannot fail')",
        f"exec({solution!r})",
    ])


def with_solutions(nb):
    """``(copy of nb, number of exercises)``: every exercise answered by its solution, and a wrong-answer
    probe after its check cell; raises :class:`ExerciseError` for malformed exercises."""
    out = copy.deepcopy(nb)
    cells, n, i = [], 0, 0
    while i < len(out.cells):
        cell = out.cells[i]
        tags = cell.get("metadata", {}).get("tags", [])
        if EXERCISE_TAG not in tags:
            cells.append(cell)
            i += 1
            continue
        spec = cell.metadata.get("exercise", {})
        if not (isinstance(spec.get("solution"), str) and isinstance(spec.get("wrong"), str)):
            raise ExerciseError(f"exercise cell {cell.get('id')}: metadata 'exercise' needs 'solution' and 'wrong' "
                                f"sources, got {json.dumps(spec)[:200]}")
        nxt = out.cells[i + 1] if i + 1 < len(out.cells) else None
        nxt_tags = nxt.get("metadata", {}).get("tags", []) if nxt is not None else []
        if not ({EXERCISE_CHECK_TAG, "self-check"} & set(nxt_tags)):
            raise ExerciseError(f"exercise cell {cell.get('id')} must be followed by a cell tagged "
                                f"{EXERCISE_CHECK_TAG!r} or 'self-check'")
        cell.source = spec["solution"]
        probe = copy.deepcopy(nxt)
        probe.source = _probe_source(spec["wrong"], nxt.source, spec["solution"])
        probe.metadata = {"tags": [EXERCISE_PROBE_TAG]}
        probe["id"] = f"{nxt.get('id', 'check')}-probe"[:64]
        cells += [cell, nxt, probe]
        n += 1
        i += 2
    out.cells = cells
    return out, n


def raise_if_unchecked(nb) -> None:
    """After a run with solutions: every exercise check passed and every probe rejected its wrong answer."""
    for cell in nb.cells:
        tags = cell.get("metadata", {}).get("tags", [])
        text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
        if EXERCISE_CHECK_TAG in tags and PASS_MARK not in text:
            raise SelfCheckError(f"exercise check {cell.get('id')} printed no {PASS_MARK!r} line with the solution")
        if EXERCISE_PROBE_TAG in tags and REJECTS_MARK not in text:
            raise SelfCheckError(f"exercise check before {cell.get('id')} did not reject the wrong answer")
