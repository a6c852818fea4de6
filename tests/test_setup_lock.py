"""The committed locks that infra/setup.sh installs without resolving (uv pip install --no-deps) still
satisfy pyproject.toml: a pin changed there without `bash infra/setup.sh --lock` would otherwise be
installed at its old version, silently."""
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
DEMO_EXTRAS = ("eval", "hf", "s3")  # setup.sh --lock: the demo's lock
TEST_EXTRAS = ("test", "bench", "eval", "hf", "s3")  # and the tests'


def read_lock(name: str) -> dict[str, str]:
    pins, hashed = {}, set()
    current = None
    for line in (ROOT / "infra" / name).read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
        if m:
            current = canonicalize_name(m.group(1))
            pins[current] = m.group(2)
        elif line.strip().startswith("--hash=sha256:") and current:
            hashed.add(current)
    assert pins, name
    assert set(pins) == hashed, f"{name}: entries without a hash: {sorted(set(pins) - hashed)}"
    return pins


def requirements(extras: tuple[str, ...]) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def test_locks_satisfy_pyproject_and_agree():
    kenlm_pin = None
    for lock, extras in (("requirements.lock", DEMO_EXTRAS), ("requirements-tests.lock", TEST_EXTRAS)):
        pins = read_lock(lock)
        for req in requirements(extras):
            name = canonicalize_name(req.name)
            if name == "kenlm":  # built from source by infra/build_kenlm.sh, not in the locks
                assert name not in pins, lock
                kenlm_pin = req.specifier
                continue
            assert name in pins, f"{lock} lacks {req}: run bash infra/setup.sh --lock"
            assert req.specifier.contains(pins[name], prereleases=True), \
                f"{lock} pins {name}=={pins[name]}, pyproject.toml asks {req}: run bash infra/setup.sh --lock"
        # torch's CPU build: the CUDA one from the index would add several GB of nvidia packages
        assert pins["torch"].endswith("+cpu"), pins["torch"]
        assert not [n for n in pins if n.startswith("nvidia-")], lock
    demo, tests = read_lock("requirements.lock"), read_lock("requirements-tests.lock")
    assert {n: v for n, v in tests.items() if n in demo} == demo, "the demo's lock must be a subset of the tests'"
    built = re.search(r'^KENLM_VERSION="([^"]+)"', (ROOT / "infra/build_kenlm.sh").read_text(), re.M).group(1)
    assert kenlm_pin is not None and kenlm_pin.contains(built), (kenlm_pin, built)
