"""Which code a record came from: the git commit where there is one, a digest of the sources always."""

import json
import subprocess

import pytest

from tutorial_lib.harness import bench
from tutorial_lib.harness.code_version import REPO_ROOT, code_version, source_digest


def _tree(root):
    (root / "tutorial_lib" / "__pycache__").mkdir(parents=True)
    (root / "kernels").mkdir()
    (root / "tutorial_lib" / "a.py").write_text("x = 1\n")
    (root / "kernels" / "k.py").write_text("y = 2\n")
    return root


def test_the_digest_follows_the_sources_and_nothing_else(tmp_path):
    root = _tree(tmp_path)
    first = source_digest(root)
    assert len(first) == 12 and first == source_digest(root)
    (root / "tutorial_lib" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0cache")
    (root / "tutorial_lib" / "notes.md").write_text("not a source")
    (root / "notebooks").mkdir()
    (root / "notebooks" / "n.py").write_text("outside the source folders")
    assert source_digest(root) == first, "caches, other file kinds and other folders do not count"
    (root / "kernels" / "k.py").write_text("y = 3\n")
    assert source_digest(root) != first, "a changed kernel is other code"
    (root / "kernels" / "k.py").write_text("y = 2\n")
    (root / "kernels" / "k.py").rename(root / "kernels" / "k2.py")
    assert source_digest(root) != first, "a moved file is other code too (paths are hashed)"


def test_an_installed_copy_digests_its_kernels_under_their_checkout_name(tmp_path):
    (tmp_path / "checkout").mkdir()
    checkout, installed = _tree(tmp_path / "checkout"), tmp_path / "site-packages"
    (installed / "tutorial_lib").mkdir(parents=True)
    (installed / "tutorial_kernels").mkdir()
    (installed / "tutorial_lib" / "a.py").write_text("x = 1\n")
    (installed / "tutorial_kernels" / "k.py").write_text("y = 2\n")
    assert source_digest(installed) == source_digest(checkout), "the same code, installed"
    (installed / "tutorial_kernels" / "k.py").write_text("y = 3\n")
    assert source_digest(installed) != source_digest(checkout), "the installed kernels count"


def test_a_folder_without_sources_has_no_digest(tmp_path):
    with pytest.raises(FileNotFoundError, match="no Python sources"):
        source_digest(tmp_path)


def test_without_git_the_commit_is_unknown_and_the_digest_still_there(tmp_path):
    v = code_version(_tree(tmp_path))
    assert (v.commit, v.dirty) == (None, None)
    assert v.source_sha256 == source_digest(tmp_path)


def test_in_a_git_checkout_the_commit_and_uncommitted_changes_are_recorded(tmp_path):
    root = _tree(tmp_path)
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "tutorial_lib/a.py", "kernels/k.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    v = code_version(root)
    assert (v.commit, v.dirty) == (head, False)
    (root / "tutorial_lib" / "a.py").write_text("x = 10\n")
    v2 = code_version(root)
    assert (v2.commit, v2.dirty) == (head, True)
    assert v2.source_sha256 != v.source_sha256


def test_every_results_file_records_the_code(tmp_path):
    path = bench.write_results(tmp_path, "demo", [], copy_GBps=1.0)
    code = json.loads(path.read_text())["code"]
    assert code == code_version(REPO_ROOT).as_dict()
