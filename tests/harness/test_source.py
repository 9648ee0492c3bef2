"""show_source / source_lines: the lines a lesson shows are the function's own, docstring dropped,
numbered as in the file, cut at the markers -- and a marker that no longer exists is an error."""

import inspect

import pytest

from tutorial_lib.harness.source import show_source, source_lines


def _sample(x):
    """A docstring
    over two lines."""
    y = x + 1  # first
    z = y * 2
    return z  # last


def _one_line_doc():
    """Only this."""
    return 1


def test_whole_function_without_docstring_and_with_file_line_numbers():
    lines, first = inspect.getsourcelines(_sample)
    got = source_lines(_sample)
    assert [n for n, _ in got] == [first, first + 3, first + 4, first + 5]
    assert [line for _, line in got] == [lines[0].rstrip(), *(s.rstrip() for s in lines[3:])]
    assert not any("docstring" in line for _, line in got)
    assert [line for _, line in source_lines(_one_line_doc)][1:] == ["    return 1"]


def test_markers_cut_the_range():
    got = source_lines(_sample, start="z = y", end="return")
    assert [line.strip() for _, line in got] == ["z = y * 2", "return z  # last"]


@pytest.mark.parametrize("kw", [{"start": "no such line"}, {"start": "z = y", "end": "y = x"}])
def test_missing_marker_is_an_error(kw):
    with pytest.raises(ValueError, match="no line of _sample"):
        source_lines(_sample, **kw)


def test_show_source_prints_a_header_with_file_and_line(capsys):
    text = show_source(_sample, start="y = x")
    out = capsys.readouterr().out
    assert out.strip() == text.strip()
    assert text.splitlines()[0] == f"# test_source.py:{inspect.getsourcelines(_sample)[1] + 3}"


def test_a_decorated_function_is_headed_by_its_own_file():
    """``@torch.no_grad()`` wraps the function in torch's ``_contextlib``: the header must still name the
    function's own file (``getsourcefile`` does not unwrap; ``getsourcelines`` does)."""
    from tutorial_lib.optim.adamw_reference import adamw_reference_step_

    assert inspect.getsourcefile(adamw_reference_step_).endswith("_contextlib.py")  # the trap is still there
    header = show_source(adamw_reference_step_).splitlines()[0]
    first = inspect.getsourcelines(adamw_reference_step_)[1]
    assert header == f"# tutorial_lib/optim/adamw_reference.py:{first}", header
