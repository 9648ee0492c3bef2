"""write_atomically / fresh_file (tutorial_lib.harness.files): a failed write keeps the old file and
leaves no private file; a name another run already took is never reused."""

import pytest

from tutorial_lib.harness import files
from tutorial_lib.harness.files import fresh_file, write_atomically


def test_a_failed_write_keeps_the_old_content_and_leaves_no_private_file(tmp_path):
    page = tmp_path / "index.html"
    write_atomically(page, "old")
    with pytest.raises(UnicodeEncodeError):
        write_atomically(page, "new \ud800")  # a lone surrogate: not encodable as UTF-8
    assert page.read_text(encoding="utf-8") == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.html"]


def test_fresh_file_skips_a_name_that_already_exists(tmp_path, monkeypatch):
    tokens = iter(["aaaa0000", "aaaa0000", "bbbb1111"])
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: next(tokens))
    first = fresh_file(tmp_path, "x.", ".tmp")
    first.write_text("taken")
    second = fresh_file(tmp_path, "x.", ".tmp")  # the first draw collides: a new name, the old file intact
    assert second != first and second.name.endswith("-bbbb1111.tmp") and second.read_text() == ""
    assert first.read_text() == "taken"
