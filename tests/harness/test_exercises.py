"""The exercise mechanism: solutions run, checks must reject a wrong answer, malformed exercises are errors."""

import nbformat
import pytest

from tutorial_lib.harness.checks import SelfCheckError
from tutorial_lib.harness.exercises import EXERCISE_CHECK_TAG, EXERCISE_TAG, NOT_ATTEMPTED, check_answer
from tutorial_lib.harness.notebooks import LessonFailed, run_lesson


def _lesson(tmp_path, exercise_meta, check_src, name="20_exercise.ipynb", start="answer = None"):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell('device = "cpu"\nworld_size = 1\nquick = True')
    params.metadata["tags"] = ["parameters"]
    work = nbformat.v4.new_code_cell("measured = 6 * 7")
    selfcheck = nbformat.v4.new_code_cell("from tutorial_lib.harness.checks import check\ncheck(measured == 42, 'x')")
    selfcheck.metadata["tags"] = ["self-check"]
    ex = nbformat.v4.new_code_cell(start)
    ex.metadata["tags"] = [EXERCISE_TAG]
    if exercise_meta is not None:
        ex.metadata["exercise"] = exercise_meta
    chk = nbformat.v4.new_code_cell(check_src)
    chk.metadata["tags"] = [EXERCISE_CHECK_TAG]
    nb.cells = [nbformat.v4.new_markdown_cell("# t\nWhat you will learn: x"), params, work, selfcheck, ex, chk]
    path = tmp_path / name
    nbformat.write(nb, path)
    return path


CHECK = "from tutorial_lib.harness.exercises import check_answer\ncheck_answer(answer, measured, 'six times seven')"


def test_check_answer_unanswered_right_and_wrong(capsys):
    check_answer(None, 42, "q")
    assert NOT_ATTEMPTED in capsys.readouterr().out
    check_answer(42, 42, "q")
    check_answer(41.9, 42.0, "q", rel_tol=0.01)
    with pytest.raises(SelfCheckError, match="your answer 41.*measured 42"):
        check_answer(41, 42, "q")


def test_solution_runs_and_the_check_rejects_the_wrong_answer(tmp_path):
    path = _lesson(tmp_path, {"solution": "answer = 42", "wrong": "answer = 41"}, CHECK)
    run = run_lesson(path, tmp_path / "out", device="cpu", world_size=1, quick=True)
    assert run.exercises == 1 and run.checks_passed == 1
    done = nbformat.read(run.executed, as_version=4)
    assert any("answer = 42" == c.source for c in done.cells), "the solution was run"
    unanswered = run_lesson(path, tmp_path / "out2", device="cpu", world_size=1, quick=True, solve_exercises=False)
    assert unanswered.exercises == 0
    assert NOT_ATTEMPTED in nbformat.read(unanswered.executed, as_version=4).cells[-1].outputs[0]["text"]


def test_a_check_that_cannot_fail_is_rejected(tmp_path):
    lax = "from tutorial_lib.harness.exercises import check_answer\ncheck_answer(answer, answer, 'anything goes')"
    path = _lesson(tmp_path, {"solution": "answer = 42", "wrong": "answer = 41"}, lax)
    with pytest.raises(LessonFailed, match="accepted a wrong answer"):
        run_lesson(path, tmp_path / "out", device="cpu", world_size=1, quick=True)


def test_a_wrong_solution_fails_the_lesson(tmp_path):
    path = _lesson(tmp_path, {"solution": "answer = 40", "wrong": "answer = 41"}, CHECK)
    with pytest.raises(LessonFailed, match="six times seven: your answer 40"):
        run_lesson(path, tmp_path / "out", device="cpu", world_size=1, quick=True)


def test_malformed_exercises_are_errors(tmp_path):
    path = _lesson(tmp_path, None, CHECK)
    with pytest.raises(LessonFailed, match="needs 'solution' and 'wrong'"):
        run_lesson(path, tmp_path / "out", device="cpu", world_size=1, quick=True)


def test_check_answer_does_not_take_a_bool_for_a_number_or_a_number_for_a_bool(capsys):
    for answer, expected, kw in ((True, 1, {}), (1, True, {}), (False, 0, {}), (True, 1.0, {"rel_tol": 0.1})):
        with pytest.raises(SelfCheckError):
            check_answer(answer, expected, "q", **kw)
    check_answer(True, True, "yes/no")
    check_answer(1.0, 1, "a count")
    assert capsys.readouterr().out.count("CHECK PASSED:") == 2
