"""What SECURITY.md promises, checked: loopback-only launches, checkpoints that cannot run code, private files.

* **Listening sockets.** During a launch, every socket the caller and every rank LISTEN on is read
  from ``/proc`` (state ``0A`` in ``/proc/<pid>/net/tcp`` and ``tcp6``, matched to the process through
  the socket inodes in ``/proc/<pid>/fd``) and must be on a loopback address. The rank functions
  below read ``/proc`` themselves while every rank waits in a barrier, so the launch is still
  running when it is inspected. ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` name a NON-loopback
  interface in the caller's environment: the launcher must override them.
* **Checkpoints.** A non-tensor leaf or a ``.metadata`` file whose pickle would create a marker
  file: plain ``dcp.load`` creates it (the pitfall), ``load_checkpoint`` refuses the item by name and
  the marker never appears; the project's own training checkpoints still load exactly.
* **Files.** Launch and checkpoint directories are mode 0700 and gone after a failure; no library
  code unpickles data that did not come from the same run (an AST scan with an explicit allowlist).

Spawned ranks import the rank functions of this module as ``test_security`` (pytest puts this
folder on ``sys.path``, and ``spawn`` hands it to every child).
"""

import ast
import datetime
import enum
import ipaddress
import os
import pathlib
import pickle
import socket
import stat
import tempfile
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch import nn

from tutorial_lib.dist.checkpoint import (
    CheckpointDir,
    UnsafeCheckpointError,
    checkpoint_dir,
    load_checkpoint,
    mismatched_keys,
    save_checkpoint,
    shared_checkpoint_dir,
)
from tutorial_lib.dist.launcher import RankFailed, launch, run_sequence
from tutorial_lib.dist.training_state import TrainingState
from tutorial_lib.optim.fused_adam import FusedAdam

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROOT = Path(__file__).resolve().parents[2]
HAVE_PROC = os.path.exists("/proc/self/net/tcp")
needs_proc = pytest.mark.skipif(not HAVE_PROC, reason="reads listening sockets from Linux's /proc")


# ----------------------------------------------------------------------------- listening sockets, from /proc


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _address(hex_addr: str) -> tuple[str, int]:
    """``0100007F:1F90`` -> ("127.0.0.1", 8080); IPv6 addresses are four host-order 32-bit words."""
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw)), int(port, 16)


def listeners(pid: int) -> list[tuple[str, int]]:
    """Every (address, port) process ``pid`` listens on with TCP, IPv4 and IPv6."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as fh:
            for line in fh.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A = TCP_LISTEN; field 9 = inode
                    found.append(_address(fields[1]))
    return sorted(set(found))


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback  # 0.0.0.0 and :: (every interface) are not


def _non_loopback_interface() -> str:
    """A non-loopback interface with an IPv4 address, for GLOO_/NCCL_SOCKET_IFNAME: a launcher that kept
    it would listen there (the test then names that listener); the launcher must override it."""
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        if any(a.family == socket.AF_INET and not is_loopback(a.address) for a in addrs):
            return name
    return "eth0"


def listeners_during_launch() -> dict:
    """Rank function: build the default group and a subgroup, then, while every rank waits, report
    the listeners of this rank and of the caller (our parent) and the interface variables."""
    sub = dist.new_group(list(range(dist.get_world_size())))
    dist.all_reduce(torch.ones(1), group=sub)  # every group of the run exists and is connected
    dist.barrier()
    report = {"rank": dist.get_rank(), "pid": os.getpid(), "own": listeners(os.getpid()),
              "caller": listeners(os.getppid()), "store_port": int(os.environ["MASTER_PORT"]),
              "GLOO_SOCKET_IFNAME": os.environ["GLOO_SOCKET_IFNAME"],
              "NCCL_SOCKET_IFNAME": os.environ["NCCL_SOCKET_IFNAME"]}
    dist.barrier()  # no rank leaves (and closes its sockets) before every rank has looked
    return report


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def private_paths_during_launch() -> dict:
    """Rank function: the modes of the launch's temp dir, this rank's TMPDIR and log, and of a
    checkpoint dir made inside the ranks."""
    rank_tmp = tempfile.gettempdir()
    launch_dir = os.path.dirname(rank_tmp)
    with shared_checkpoint_dir() as shared:
        shared_mode = _mode(shared)
    dist.barrier()  # rank 0 removes the shared dir on leaving the block: wait for it before looking
    return {"launch_dir": launch_dir, "launch_dir_mode": _mode(launch_dir), "rank_tmp_mode": _mode(rank_tmp),
            "log_mode": _mode(os.path.join(launch_dir, f"rank{dist.get_rank()}.log")),
            "shared_checkpoint_dir_mode": shared_mode, "shared_checkpoint_dir_gone": not os.path.exists(shared)}


def record_launch_dir_then_fail(out: str) -> None:
    """Rank function: write the launch's temp dir into ``out`` (rank 0), then fail on every rank."""
    if dist.get_rank() == 0:
        Path(out).write_text(os.path.dirname(tempfile.gettempdir()))
    dist.barrier()
    raise RuntimeError("failing on purpose after recording the launch dir")


@pytest.fixture(scope="module")
def launched():
    """One 2-rank CPU launch running both rank functions; the caller's listeners before and after it."""
    with pytest.MonkeyPatch.context() as mp:
        bad = _non_loopback_interface()
        mp.setenv("GLOO_SOCKET_IFNAME", bad)
        mp.setenv("NCCL_SOCKET_IFNAME", bad)
        before = listeners(os.getpid()) if HAVE_PROC else []
        calls = [(listeners_during_launch, {}), (private_paths_during_launch, {})] if HAVE_PROC \
            else [(private_paths_during_launch, {})]
        results = launch(run_sequence, world_size=2, device="cpu", args=(calls,), timeout=180, echo=False)
        after = listeners(os.getpid()) if HAVE_PROC else []
    return {"before": before, "after": after, "ranks": results, "interface": bad}


@needs_proc
def test_the_detector_sees_a_socket_on_every_interface():
    """The check is not vacuous: a socket bound to 0.0.0.0 shows up as a non-loopback listener."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        mine = [a for a, p in listeners(os.getpid()) if p == port]
    assert mine == ["0.0.0.0"] and not is_loopback(mine[0])
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("::") and not is_loopback("192.0.2.2")


@needs_proc
def test_a_plain_tcpstore_on_127_0_0_1_listens_on_every_interface():
    """The pitfall the launcher avoids: the host name of a server TCPStore only tells clients where to
    connect. If this fails, torch changed: update SECURITY.md and the launcher's docstring."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    try:
        addresses = [a for a, p in listeners(os.getpid()) if p == store.port]
    finally:
        del store
    assert addresses and not any(is_loopback(a) for a in addresses), addresses


@needs_proc
def test_every_socket_of_a_launch_listens_on_loopback_only(launched):
    reports = [r[0] for r in launched["ranks"]]
    port = reports[0]["store_port"]
    new_in_caller = sorted(set(reports[0]["caller"]) - set(launched["before"]))
    assert port in [p for _, p in new_in_caller], f"the rendezvous store's port {port} not among {new_in_caller}"
    offending = {"caller": [x for x in new_in_caller if not is_loopback(x[0])]}
    for r in reports:
        assert r["own"], f"rank {r['rank']} listens on nothing: gloo's listeners were not seen"
        offending[f"rank {r['rank']}"] = [x for x in r["own"] if not is_loopback(x[0])]
    assert not any(offending.values()), f"non-loopback listeners during a launch: {offending}"
    assert not [x for x in launched["after"] if x[1] == port], "the store still listens after the launch"


def test_ranks_override_the_interface_variables_of_the_environment(launched):
    if not HAVE_PROC:
        pytest.skip("the interface report comes with the /proc inspection")
    for r in (res[0] for res in launched["ranks"]):
        assert r["GLOO_SOCKET_IFNAME"] in ("lo", "lo0") and r["NCCL_SOCKET_IFNAME"] in ("lo", "lo0"), \
            f"caller set {launched['interface']!r}; rank {r['rank']} kept {r['GLOO_SOCKET_IFNAME']!r}"


# ----------------------------------------------------------------------------- private files


def test_launch_files_are_private_and_gone_afterwards(launched):
    for res in launched["ranks"]:
        paths = res[-1]
        assert paths["launch_dir_mode"] == 0o700 and paths["rank_tmp_mode"] == 0o700, paths
        assert paths["log_mode"] == 0o600, paths
        assert paths["shared_checkpoint_dir_mode"] == 0o700 and paths["shared_checkpoint_dir_gone"], paths
        assert not os.path.exists(paths["launch_dir"]), "the launch's temp dir outlived the launch"


def test_a_failed_launch_removes_its_temp_dir(tmp_path):
    out = tmp_path / "launch_dir"
    with pytest.raises(RankFailed, match="failing on purpose"):
        launch(record_launch_dir_then_fail, world_size=2, device="cpu", args=(str(out),), timeout=120, echo=False)
    launch_dir = out.read_text()
    assert launch_dir and not os.path.exists(launch_dir), f"{launch_dir} outlived the failed launch"


def test_checkpoint_dirs_are_private_and_removed_on_failure(tmp_path):
    old = os.umask(0)  # the modes must not depend on a strict umask
    try:
        with pytest.raises(RuntimeError, match="step failed"), checkpoint_dir(root=tmp_path) as root:
            assert _mode(root) == 0o700
            save_checkpoint({"w": torch.ones(2)}, os.path.join(root, "made-by-save"))
            assert _mode(os.path.join(root, "made-by-save")) == 0o700, "a directory save_checkpoint creates is private"
            raise RuntimeError("step failed")
        assert list(tmp_path.iterdir()) == [], "checkpoint_dir left its directory after a failure"
        d = CheckpointDir(root=tmp_path)
        assert _mode(d.path) == 0o700
        d.cleanup()
        assert d.removed
    finally:
        os.umask(old)


# ----------------------------------------------------------------------------- checkpoints cannot run code


class _CreatesMarker:
    """A pickle that creates ``marker`` when unpickled: what a malicious checkpoint would do (worse)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def _poisoned_leaf_checkpoint(root: Path) -> tuple[Path, Path]:
    marker = root / "code-ran"
    path = root / "ckpt"
    save_checkpoint({"w": torch.arange(4.0), "optim": {"param_groups": {"lr": 0.1, "hook": _CreatesMarker(marker)}}},
                    path)
    assert not marker.exists()
    return path, marker


def _targets():
    return {"w": torch.zeros(4), "optim": {"param_groups": {"lr": 0.0, "hook": None}}}


def test_plain_dcp_load_runs_the_code_in_a_non_tensor_leaf(tmp_path):
    """The pitfall: DCP's default planner unpickles non-tensor leaves with weights_only=False."""
    path, marker = _poisoned_leaf_checkpoint(tmp_path)
    dcp.load(_targets(), checkpoint_id=path, no_dist=True)
    assert marker.exists(), "plain dcp.load ran the pickle's code"


def test_load_checkpoint_refuses_a_non_tensor_leaf_that_would_run_code(tmp_path):
    path, marker = _poisoned_leaf_checkpoint(tmp_path)
    with pytest.raises(UnsafeCheckpointError) as info:
        load_checkpoint(_targets(), path)
    assert info.value.key == "optim.param_groups.hook"
    msg = str(info.value)
    assert "'optim.param_groups.hook' was refused" in msg and "not an allowed global" in msg and "run code" in msg
    assert not marker.exists(), "load_checkpoint ran the pickle's code"


def _poisoned_metadata_checkpoint(root: Path) -> tuple[Path, Path]:
    marker = root / "code-ran"
    path = root / "ckpt"
    save_checkpoint({"w": torch.arange(4.0)}, path)
    with open(path / ".metadata", "wb") as fh:
        pickle.dump(_CreatesMarker(marker), fh)
    return path, marker


def test_plain_dcp_load_runs_the_code_in_the_metadata_file(tmp_path):
    path, marker = _poisoned_metadata_checkpoint(tmp_path)
    with pytest.raises(BaseException):  # noqa: B017, PT011 - DCP fails AFTER the code ran: that is the point
        dcp.load({"w": torch.zeros(4)}, checkpoint_id=path, no_dist=True)
    assert marker.exists(), "plain dcp.load unpickled .metadata with pickle.load"


def test_load_checkpoint_refuses_a_metadata_file_that_would_run_code(tmp_path):
    path, marker = _poisoned_metadata_checkpoint(tmp_path)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata was refused: it asks for pathlib\.Path\.touch"):
        load_checkpoint({"w": torch.zeros(4)}, path)
    assert not marker.exists(), "load_checkpoint ran the metadata's code"


class _EnumByGetattr(pickle.Pickler):
    """Pickles enum members as ``getattr(EnumClass, "NAME")``, as some Pythons (3.11.2) do by themselves."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


class _Getattr:
    """A pickle that calls ``getattr(cls, name)`` -- for a lookup that is not an enum member."""

    def __init__(self, cls, name):
        self.cls, self.name = cls, name

    def __reduce__(self):
        return getattr, (self.cls, self.name)


def test_metadata_with_enum_members_pickled_by_getattr_loads_and_other_getattrs_are_refused(tmp_path):
    """Whichever way the Python that saved a checkpoint pickles DCP's enum members, load_checkpoint reads it;
    a getattr that is not an enum member's lookup stays refused."""
    path = tmp_path / "ckpt"
    save_checkpoint({"w": torch.arange(4.0)}, path)
    with open(path / ".metadata", "rb") as fh:
        metadata = pickle.load(fh)  # our own checkpoint: trusted here
    with open(path / ".metadata", "wb") as fh:
        _EnumByGetattr(fh).dump(metadata)
    assert b"getattr" in (path / ".metadata").read_bytes()
    target = {"w": torch.zeros(4)}
    load_checkpoint(target, path)
    assert torch.equal(target["w"], torch.arange(4.0))
    for cls, name in ((pathlib.PosixPath, "touch"), (dcp_metadata._MEM_FORMAT_ENCODING, "__class__")):
        with open(path / ".metadata", "wb") as fh:
            pickle.dump(_Getattr(cls, name), fh)
        with pytest.raises(UnsafeCheckpointError, match=r"\.metadata was refused: it calls getattr"):
            load_checkpoint({"w": torch.zeros(4)}, path)


def test_a_training_checkpoint_with_fused_adam_loads_exactly(tmp_path, one_thread):
    """The project's own non-tensor leaves (FusedAdam's param_groups) are plain data: weights_only loads them."""
    def build(seed, **hyper):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dev)
        return model, FusedAdam(model.parameters(), **hyper)

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # FusedAdam's kernels: compiled for GPU tensors

    model, opt = build(0, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    for _ in range(2):
        model(torch.randn(5, 8, device=dev)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    save_checkpoint({"app": TrainingState(model, opt)}, tmp_path / "ckpt")
    fresh_model, fresh_opt = build(1, lr=0.5, betas=(0.5, 0.5), weight_decay=0.0)  # other weights AND hyper-params
    load_checkpoint({"app": TrainingState(fresh_model, fresh_opt)}, tmp_path / "ckpt")
    assert mismatched_keys(fresh_model.state_dict(), model.state_dict()) == []
    assert mismatched_keys(fresh_opt.state_dict()["state"], opt.state_dict()["state"]) == []
    saved_group, loaded_group = opt.state_dict()["param_groups"][0], fresh_opt.state_dict()["param_groups"][0]
    assert {k: loaded_group[k] for k in saved_group} == saved_group  # lr, betas, eps, weight_decay, block, ...
    assert loaded_group["betas"] == (0.8, 0.95) and loaded_group["weight_decay"] == 0.1


# ----------------------------------------------------------------------------- no unsafe unpickling in the library

# (file, enclosing function or class) -> why unpickling there is safe. Anything else fails the test.
ALLOWED_UNPICKLING = {
    ("tutorial_lib/dist/launcher.py", "_launch_once"):
        "reads the results its own ranks wrote into the launch's private (0700) temp dir: data of the same run",
    ("tutorial_lib/dist/launch_rank.py", "_load_call"):
        "unpickles, in a rank, the function and arguments its own caller pickled for this launch into the "
        "launch's private (0700) temp dir (what multiprocessing's spawn would otherwise unpickle there): data of "
        "the same run",
    ("tutorial_lib/dist/checkpoint_checks.py", "_MetadataUnpickler"):
        "restricted unpickler: find_class resolves only DCP's metadata dataclasses, torch.Size, dtypes and paths",
}
# Object collectives (all_gather_object, broadcast_object_list, ...) unpickle what PEER RANKS of the same
# run sent: the process group is the trust boundary (SECURITY.md), so they are not listed here.
_PICKLE_CALLS = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("marshal", "loads"),
                 ("marshal", "load"), ("dill", "load"), ("dill", "loads"), ("cloudpickle", "load"),
                 ("cloudpickle", "loads"), ("shelve", "open")}


def _unpickling_sites(path: Path) -> list[tuple[str, int, str]]:
    """(enclosing function/class, line, what) for every call that may unpickle untrusted data."""
    tree = ast.parse(path.read_text())
    sites = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else scope
            if isinstance(child, ast.ClassDef):
                for base in child.bases:
                    if isinstance(base, ast.Attribute) and ast.unparse(base) == "pickle.Unpickler":
                        sites.append((inner, child.lineno, "subclass of pickle.Unpickler"))
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                owner = ast.unparse(child.func.value)
                name = child.func.attr
                if (owner.split(".")[-1], name) in _PICKLE_CALLS:
                    sites.append((scope, child.lineno, f"{owner}.{name}"))
                if owner == "torch" and name == "load":
                    kw = {k.arg: k.value for k in child.keywords}
                    safe = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
                    if not safe:
                        sites.append((scope, child.lineno, "torch.load without weights_only=True"))
                if name == "load" and "allow_pickle" in {k.arg for k in child.keywords}:
                    sites.append((scope, child.lineno, f"{owner}.load(allow_pickle=...)"))
            visit(child, inner)

    visit(tree, "<module>")
    return sites


def test_no_library_code_unpickles_data_from_outside_the_run():
    files = sorted([*(ROOT / "tutorial_lib").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])
    found, unexplained = set(), []
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        for scope, line, what in _unpickling_sites(f):
            found.add((rel, scope))
            if (rel, scope) not in ALLOWED_UNPICKLING:
                unexplained.append(f"{rel}:{line} in {scope}: {what}")
    assert not unexplained, ("unpickling that may read data from outside the run (use weights_only=True, or add "
                             "the site to ALLOWED_UNPICKLING with the reason it is safe):\n" + "\n".join(unexplained))
    assert set(ALLOWED_UNPICKLING) <= found, f"stale allowlist entries: {set(ALLOWED_UNPICKLING) - found}"
