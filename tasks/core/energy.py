"""Energy, CO2e and cost of every stage, measured with CodeCarbon's method without its dependency
tree (pandas, a location API, its own scheduler); `crucible plan` estimates a planned run with the
same constants.

What a stage's record counts (its `method` says which path was taken):

* CPU time of the stage's process tree: the process running the stage and every descendant (the
  local Ray's raylet and workers that `ray.init` starts, torchrun and its ranks, tokenizer
  subprocesses), read from /proc every `energy.sample_interval_s`; this process's own time through
  `time.process_time()` (nanoseconds: a stage of a few milliseconds still counts). Attached to a Ray
  cluster (`ray.address` / RAY_ADDRESS), this node's Ray worker processes (`ray::...`, same user)
  count too; other nodes' workers are not measured. A descendant is counted up to its last sample,
  so one that lives less than one interval is missed; so is work other threads of this process do
  at the same time.
* CPU power: RAPL (/sys/class/powercap/intel-rapl:N/energy_uj, package domains) where readable,
  times the tree's share of the node's busy CPU time (/proc/stat); else TDP x utilisation, as
  CodeCarbon does without RAPL: `cpu_tdp_w` x tree CPU-seconds / the threads the TDP covers (85 W,
  CodeCarbon's default for an unknown CPU, over the socket's hardware threads unless configured).
* GPU: `nvidia-smi` board power (power.draw) of the visible GPUs, the mean of samples every
  interval x the board's charged time (whole boards: idle power included, as the run pays for it);
  a board without a power reading: `energy.gpu_tdp_w`, else its power limit, else the price
  table's `plan.gpus[...].tdp_w`, x utilization.gpu.
* Overlapping blocks (a triggered evaluate or deploy while train runs): the GPU boards and an
  attached cluster's Ray workers are shared, so each is charged once: to the block of the run that
  started measuring it first; a later block is charged only the part of its wall time no earlier
  one covered (the run's ledger energy-claims.jsonl, class Claims; `method` says so).
* A block that raises is recorded with "status": "failed" (its energy was spent; totals count it).
* Not counted: memory, disks, network, cooling (no PUE factor).

CO2e = kWh x `energy.grid_gco2e_per_kwh` / 1000. Cost, from the planner's price table
(tasks/config.py `plan`): CPU-core-hours x plan.curate.node_price_per_hour / cores_per_node plus
GPU-hours (the visible GPUs' charged time) x plan.gpus[energy.gpu or plan.gpu].price_per_hour.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tasks.config import EnergyConfig, PipelineConfig, PlanConfig

DEFAULT_CPU_TDP_W = 85.0  # CodeCarbon's power for a CPU it does not find in its table
RAPL_ROOT = Path("/sys/class/powercap")
PROC = Path("/proc")
CLK_TCK = os.sysconf("SC_CLK_TCK")
J_PER_KWH = 3.6e6
NVIDIA_QUERY = "index,power.draw,power.limit,utilization.gpu"


# ---------------------------------------------------------------------------------- prices


def gpu_price_per_hour(energy: EnergyConfig, plan: PlanConfig) -> tuple[str, float]:
    """(entry, USD per GPU-hour) of the planner's table the measured GPU-hours are priced at."""
    key = (energy.gpu or plan.gpu).lower()
    if key not in plan.gpus:
        raise ValueError(f"energy.gpu {key!r} is not in plan.gpus ({', '.join(sorted(plan.gpus))})")
    return key, plan.gpus[key].price_per_hour


def cpu_core_price_per_hour(plan: PlanConfig) -> float:
    """USD per CPU-core-hour: the curation planner's node price over its cores."""
    return plan.curate.node_price_per_hour / plan.curate.cores_per_node


def co2e_kg(kwh: float, energy: EnergyConfig) -> float:
    return kwh * energy.grid_gco2e_per_kwh / 1000.0


# ---------------------------------------------------------------------------- /proc readers


def _stat(pid: int) -> tuple[int, float, str, int] | None:
    """(ppid, user+system CPU seconds, comm, start time in ticks) of a live process, None if gone."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    close = raw.rfind(")")
    comm, fields = raw[raw.find("(") + 1:close], raw[close + 2:].split()
    # fields[0] is stat's 3rd field (state): ppid 4th, utime 14th, stime 15th, starttime 22nd
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK, comm, int(fields[19])


def node_busy_seconds() -> float:
    """CPU-seconds every CPU of this node spent outside idle and iowait, since boot (/proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in
                                                               (PROC / "stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def cpu_threads_per_socket() -> int:
    """Hardware threads of one CPU package (/proc/cpuinfo `siblings`), else the CPUs this OS shows."""
    try:
        m = re.search(r"^siblings\s*:\s*(\d+)", (PROC / "cpuinfo").read_text(), re.M)
    except OSError:
        m = None
    return int(m.group(1)) if m else (os.cpu_count() or 1)


def ray_attached(cfg: PipelineConfig | None) -> bool:
    return bool((cfg.ray.address if cfg is not None else None) or os.environ.get("RAY_ADDRESS"))


class ProcessTree:
    """User+system CPU seconds of a process and its descendants since `start()`, sampled.

    A child this process waited for (subprocess.run, torchrun and the ranks it waited for) counts
    in full through os.times()'s children time, which the kernel adds when it is reaped; it
    replaces the sampled time of that child's subtree (which misses its last interval)."""

    def __init__(self, root: int | None = None, ray_workers: bool = False):
        self.root = root or os.getpid()
        self.ray_workers = ray_workers
        self.base: dict[tuple[int, int], float] = {}
        self.last: dict[tuple[int, int], float] = {}
        self.parent: dict[tuple[int, int], int] = {}
        self.live: set[tuple[int, int]] = set()
        self.ray_keys: set[tuple[int, int]] = set()  # Ray workers that are not this tree's descendants
        self.own0 = self.own = self.reaped0 = self.reaped = 0.0

    def members(self) -> dict[tuple[int, int], tuple[float, int]]:
        """(pid, start ticks) -> (CPU seconds, ppid) of every descendant of root (and Ray workers if asked)."""
        stats, children = {}, {}
        uid = os.getuid()
        if not PROC.is_dir():  # no procfs (macOS): this process's own time only
            return {}
        for entry in os.scandir(PROC):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            st = _stat(pid)
            if st is None:
                continue
            stats[pid] = st
            children.setdefault(st[0], []).append(pid)
        out, seen = {}, {self.root}

        def walk(todo: list[int]) -> set[tuple[int, int]]:
            keys = set()
            while todo:
                pid = todo.pop()
                if pid in seen or pid not in stats:
                    continue
                seen.add(pid)
                key = (pid, stats[pid][3])
                out[key] = (stats[pid][1], stats[pid][0])
                keys.add(key)
                todo += children.get(pid, [])
            return keys

        walk(list(children.get(self.root, [])))
        if self.ray_workers:  # an attached cluster's workers on this node are nobody's children here
            self.ray_keys |= walk([p for p, st in stats.items() if st[2].startswith("ray::") and _owner(p) == uid])
        return out

    def _times(self) -> None:
        t = os.times()
        self.own, self.reaped = time.process_time(), t.children_user + t.children_system

    def start(self) -> None:
        self._times()
        self.own0, self.reaped0 = self.own, self.reaped
        self.sample()
        self.base = dict(self.last)

    def sample(self) -> None:
        members = self.members()
        self._times()
        self.live = set(members)
        for k, (cpu, ppid) in members.items():
            self.last[k], self.parent[k] = cpu, ppid

    def cpu_seconds(self, ray_share: float = 1.0) -> float:
        """The tree's CPU-seconds since start, the attached cluster's Ray workers' x `ray_share`."""
        # a process first seen after start began during the stage: all of its time is the stage's
        used = {k: max(0.0, v - self.base.get(k, 0.0)) for k, v in self.last.items()}
        gone_pids = {k[0]: k for k in self.last if k not in self.live}
        # gone subtrees hanging off root: reaped by it (counted in os.times) unless orphaned first
        reaped = set()
        for k in gone_pids.values():
            chain, p = [k], self.parent.get(k)
            while p in gone_pids and gone_pids[p] not in chain:
                chain.append(gone_pids[p])
                p = self.parent.get(gone_pids[p])
            if p == self.root:
                reaped.update(chain)
        sampled_reaped = sum(used[k] for k in reaped)
        # os.times adds a reaped child's whole life: what it had used before start is not the stage's
        reaped_delta = self.reaped - self.reaped0 - sum(self.base.get(k, 0.0) for k in reaped)
        rest = sum(v for k, v in used.items() if k not in reaped and k not in self.ray_keys)
        ray = sum(v for k, v in used.items() if k not in reaped and k in self.ray_keys)
        return (self.own - self.own0) + rest + ray * ray_share + max(sampled_reaped, reaped_delta)


def _owner(pid: int) -> int | None:
    try:
        return (PROC / str(pid)).stat().st_uid
    except OSError:
        return None


# ------------------------------------------------------------------------------------- RAPL


def rapl_packages() -> list[Path]:
    """Readable RAPL package domains (intel-rapl:N; AMD's amd-rapl likewise), [] where none are."""
    out = []
    for d in sorted(RAPL_ROOT.glob("*-rapl:*")):
        if re.fullmatch(r"[a-z]+-rapl:\d+", d.name):
            try:
                int((d / "energy_uj").read_text())
                out.append(d)
            except (OSError, ValueError):  # root-only since the 2020 side-channel fix, on most hosts
                return []
    return out


class Rapl:
    """Package energy in joules since start, counter wrap-arounds handled between samples."""

    def __init__(self, packages: list[Path]):
        self.packages = packages
        self.ranges = [int((p / "max_energy_range_uj").read_text()) for p in packages]
        self.prev = self._read()
        self.joules = 0.0

    def _read(self) -> list[int]:
        return [int((p / "energy_uj").read_text()) for p in self.packages]

    def sample(self) -> None:
        now = self._read()
        for i, (a, b) in enumerate(zip(self.prev, now)):
            self.joules += ((b - a) if b >= a else (b + self.ranges[i] - a)) / 1e6
        self.prev = now


# -------------------------------------------------------------------------------------- GPU


def _float(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_nvidia_smi(lines: str) -> dict[int, tuple[float | None, float | None, float | None]]:
    """{gpu index: (power.draw W, power.limit W, utilization.gpu %)} from csv,noheader,nounits rows."""
    out = {}
    for line in lines.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit():
            out[int(parts[0])] = (_float(parts[1]), _float(parts[2]), _float(parts[3]))
    return out


def visible_gpus() -> str | None:
    """nvidia-smi's -i for CUDA_VISIBLE_DEVICES (indices or UUIDs: both tools take either); None: all
    GPUs; "": none (CUDA_VISIBLE_DEVICES set but empty hides every GPU from the stage)."""
    v = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if v is None else v.strip()


def gpu_watts(row: tuple[float | None, float | None, float | None], tdp_override: float | None,
              table_tdp: float | None = None) -> tuple[float, bool]:
    """(watts, measured) of one nvidia-smi row: the board's power.draw when it reports one; else a
    TDP x utilization.gpu, the TDP being energy.gpu_tdp_w, else the board's power.limit, else the
    price-table entry's tdp_w."""
    draw, limit, util = row
    if draw is not None:
        return draw, True
    tdp = tdp_override or limit or table_tdp or 0.0
    return tdp * (util or 0.0) / 100.0, False


class GpuSampler:
    """`nvidia-smi --query-gpu ... --loop-ms=N` as one child process streaming a row per GPU per interval."""

    def __init__(self, interval_s: float):
        self.rows: list[dict] = []
        self.proc = None
        exe, visible = shutil.which("nvidia-smi"), visible_gpus()
        if not exe or visible == "":
            return
        cmd = [exe, f"--query-gpu={NVIDIA_QUERY}", "--format=csv,noheader,nounits"] + (["-i", visible] if visible else [])
        try:
            first = parse_nvidia_smi(subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout)
        except (OSError, subprocess.SubprocessError):
            return
        if not first:
            return
        self.rows.append(first)
        self.gpus = sorted(first)
        self.proc = subprocess.Popen(cmd + [f"--loop-ms={max(100, int(interval_s * 1000))}"], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True, name="energy-nvidia-smi")
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.rows.append(parse_nvidia_smi(line))

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.reader.join(timeout=5)

    def joules(self, seconds: dict[int, float], tdp_override: float | None, table_tdp: float | None
               ) -> tuple[float, bool]:
        """(joules, every reading measured): per GPU the mean power of its samples x its `seconds`."""
        total, measured = 0.0, True
        for gpu in self.gpus if self.proc is not None else ():
            watts = [gpu_watts(r[gpu], tdp_override, table_tdp) for r in self.rows if gpu in r]
            measured &= all(m for _, m in watts)
            total += sum(w for w, _ in watts) / max(1, len(watts)) * seconds[gpu]
        return total, measured

    @property
    def boards(self) -> list[int]:
        return self.gpus if self.proc is not None else []


# ---------------------------------------------------------------------------- claims ledger

RAY_WORKERS = "ray-workers"


class Claims:
    """The run's ledger of measured intervals of shared resources (this host's GPU boards, an attached
    cluster's Ray workers on it), next to its energy.jsonl: stage blocks that overlap (a triggered
    evaluate or deploy while train runs) would each charge the same boards for the same time, so a
    resource's time goes to the block that started measuring it first. A block is charged, per
    resource, the part of its interval that no earlier-started block of the run on this host
    covered (a block still open counts as covering up to now; one whose process died without
    closing is ignored). Lines: {"id", "host", "pid", "ticks", "start", "resources"} at start,
    {"id", "end"} at stop."""

    def __init__(self, path: Path, resources: list[str]):
        self.path, self.resources = path, resources
        self.id, self.host, self.start = uuid.uuid4().hex, socket.gethostname(), time.time()
        st = _stat(os.getpid())
        self._append({"id": self.id, "host": self.host, "pid": os.getpid(), "ticks": st[3] if st else None,
                      "start": self.start, "resources": resources})

    def _append(self, line: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:  # one short appended line per write: concurrent writers interleave whole lines
            f.write(json.dumps(line) + "\n")

    def close(self, seconds: float) -> dict[str, float]:
        """{resource: share (0..1) of this block's interval charged to it}; records the block's end
        (start + the meter's `seconds`: the interval the record's wall time is)."""
        end = self.start + seconds
        self._append({"id": self.id, "end": end})
        opened, ended = {}, {}
        for line in self.path.read_text().splitlines():
            rec = json.loads(line) if line.strip() else {}
            if "start" in rec:
                opened[rec["id"]] = rec
            elif "end" in rec:
                ended[rec["id"]] = rec["end"]
        covering: dict[str, list[tuple[float, float]]] = {r: [] for r in self.resources}
        for cid, rec in opened.items():
            if (rec["start"], cid) >= (self.start, self.id) or rec["host"] != self.host:
                continue
            if cid not in ended and not _alive(rec["pid"], rec["ticks"]):
                continue  # died without closing: it records nothing, so it claims nothing
            span = (max(rec["start"], self.start), min(ended.get(cid, end), end))
            for r in set(rec["resources"]) & set(self.resources):
                if span[1] > span[0]:
                    covering[r].append(span)
        length = max(end - self.start, 1e-9)
        return {r: max(0.0, 1.0 - _union(spans) / length) for r, spans in covering.items()}


def _union(spans: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _alive(pid: int, ticks: int | None) -> bool:
    st = _stat(pid)
    return st is not None and (ticks is None or st[3] == ticks)


def claims_path(log: Path) -> Path:
    return log.with_name("energy-claims.jsonl")


# ------------------------------------------------------------------------------------ meter


class EnergyMeter:
    """Measures one stage: `start()`, then `stop()` returns its record (see the module docstring)."""

    def __init__(self, cfg: PipelineConfig, claims: Path | None = None):
        self.cfg, self.energy, self.claims_path = cfg, cfg.energy, claims
        self.gpu_key, self.gpu_price = gpu_price_per_hour(self.energy, cfg.plan)
        self.record: dict | None = None
        self.claims: Claims | None = None
        self._stop = threading.Event()

    def start(self) -> "EnergyMeter":
        self.tree = ProcessTree(ray_workers=ray_attached(self.cfg))
        packages = [] if self.energy.cpu_tdp_w else rapl_packages()
        self.rapl = Rapl(packages) if packages else None
        self.busy0 = node_busy_seconds() if self.rapl else 0.0
        self.gpu = GpuSampler(self.energy.sample_interval_s)
        shared = [f"gpu:{g}" for g in self.gpu.boards] + ([RAY_WORKERS] if self.tree.ray_workers else [])
        if self.claims_path is not None and shared:
            self.claims = Claims(self.claims_path, shared)
        self.t0 = time.perf_counter()
        self.tree.start()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="energy-meter")
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.energy.sample_interval_s):
            self.tree.sample()
            if self.rapl:
                self.rapl.sample()

    def stop(self, status: str = "ok") -> dict:
        self._stop.set()
        self.thread.join()
        self.tree.sample()
        seconds = time.perf_counter() - self.t0
        self.gpu.stop()
        share = self.claims.close(seconds) if self.claims else {}
        cpu_s = self.tree.cpu_seconds(share.get(RAY_WORKERS, 1.0))
        if self.rapl:
            self.rapl.sample()
            busy = node_busy_seconds() - self.busy0
            tree_share = min(1.0, cpu_s / busy) if busy > 0 else 0.0
            cpu_j = self.rapl.joules * tree_share
            cpu_method = (f"RAPL package energy ({len(self.rapl.packages)} package(s)) x the process tree's "
                          f"share ({tree_share:.3f}) of the node's busy CPU time")
        else:
            tdp = self.energy.cpu_tdp_w or DEFAULT_CPU_TDP_W
            threads = self.energy.cpu_tdp_threads or cpu_threads_per_socket()
            cpu_j = tdp / threads * cpu_s
            cpu_method = (f"CPU TDP x utilisation: {tdp:g} W over {threads} hardware threads x the process tree's "
                          f"CPU-seconds" + ("" if self.energy.cpu_tdp_w else " (TDP: CodeCarbon's default, RAPL "
                                                                               "not readable)"))
        boards = self.gpu.boards
        gpu_s = {g: seconds * share.get(f"gpu:{g}", 1.0) for g in boards}
        gpu_j, measured = self.gpu.joules(gpu_s, self.energy.gpu_tdp_w, self.cfg.plan.gpus[self.gpu_key].tdp_w)
        gpu_method = ("no GPU" if not boards else
                      f"{len(boards)} GPU(s): nvidia-smi board power.draw, mean of samples x the boards' charged "
                      "time" if measured else
                      f"{len(boards)} GPU(s): energy.gpu_tdp_w, else the board's power.limit, else "
                      f"plan.gpus.{self.gpu_key}.tdp_w, x utilization.gpu where no power.draw, x the charged time")
        if boards or self.tree.ray_workers:
            gpu_method += ("; shared resources (GPU boards, Ray workers) charged only for the part of the wall "
                           "time no earlier-started block of the run on this host measured them"
                           + ("" if self.claims else " (no run ledger: the whole wall time)"))
        kwh = (cpu_j + gpu_j) / J_PER_KWH
        gpu_hours = sum(gpu_s.values()) / 3600.0
        self.record = {
            "kwh": kwh, "cpu_kwh": cpu_j / J_PER_KWH, "gpu_kwh": gpu_j / J_PER_KWH,
            "co2e_kg": co2e_kg(kwh, self.energy),
            "cost_usd": cpu_s / 3600.0 * cpu_core_price_per_hour(self.cfg.plan) + gpu_hours * self.gpu_price,
            "cpu_core_seconds": cpu_s, "gpu_hours": gpu_hours, "seconds": seconds, "status": status,
            "grid_gco2e_per_kwh": self.energy.grid_gco2e_per_kwh,
            "method": f"{cpu_method}; {gpu_method}; memory, disk and network not counted",
            "scope": "process tree" + (" + this node's Ray workers (attached cluster)" if self.tree.ray_workers else ""),
            "prices": f"CPU-core-hour ${cpu_core_price_per_hour(self.cfg.plan):.4f} (plan.curate), "
                      f"GPU-hour ${self.gpu_price:g} (plan.gpus.{self.gpu_key})",
        }
        return self.record


@contextmanager
def measure_energy(cfg: PipelineConfig, log: Path | None = None, stage: str | None = None
                   ) -> Iterator[EnergyMeter | None]:
    """Measure the block; afterwards `meter.record` holds the record, also appended to `log` (the
    run's energy.jsonl, which the model card reads) as {"stage", **record}; overlapping blocks of
    the run share its GPU boards and Ray workers through the ledger next to `log` (Claims). Yields
    None when energy.enabled is off. A block that raises is recorded too, with "status": "failed"
    (the energy was spent: the run totals and the model card count it), and the exception goes on."""
    if not cfg.energy.enabled:
        yield None
        return
    meter = EnergyMeter(cfg, claims_path(log) if log is not None else None).start()
    try:
        yield meter
    except BaseException:
        _append_record(log, stage, meter.stop("failed"))
        raise
    _append_record(log, stage, meter.stop())


def _append_record(log: Path | None, stage: str | None, record: dict) -> None:
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as f:
            f.write(json.dumps({"stage": stage, **record}) + "\n")


# ------------------------------------------------------------------------------ aggregates

TOTALS = ("kwh", "cpu_kwh", "gpu_kwh", "co2e_kg", "cost_usd", "cpu_core_seconds", "gpu_hours")


def total(records: list[dict]) -> dict:
    return {k: sum(r[k] for r in records) for k in TOTALS}


def run_energy(records: list[dict]) -> dict | None:
    """The run's energy from its energy.jsonl records: per stage (a stage run several times, e.g.
    evaluate once per checkpoint, in the pipeline or in the event-triggered flows, and failed
    attempts ("status": "failed"): summed) and the total; None when nothing was recorded
    (energy.enabled off)."""
    per: dict[str, list[dict]] = {}
    for r in records:
        per.setdefault(r.get("stage") or "?", []).append(r)
    if not per:
        return None
    stages = {name: total(rs) for name, rs in per.items()}
    return {"stages": stages, "total": total(list(stages.values()))}


def read_log(path: Path) -> list[dict]:
    """The records of a run's energy.jsonl, in order ([] when there is none)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def card_section(records: list[dict]) -> str:
    """The model card's energy section from a run's energy.jsonl records."""
    if not records:
        return "Not recorded (no energy log in the checkpoint's run, or energy.enabled was off)."
    energy = run_energy(records)
    rows, t = energy["stages"], energy["total"]
    lines = ["| stage | energy (kWh) | CO2e (kg) | cost (USD) |", "|---|---|---|---|"]
    lines += [f"| {n} | {v['kwh']:.3g} | {v['co2e_kg']:.3g} | {v['cost_usd']:.3g} |" for n, v in rows.items()]
    lines.append(f"| **total** | {t['kwh']:.3g} | {t['co2e_kg']:.3g} | {t['cost_usd']:.3g} |")
    last = records[-1]
    return ("\n".join(lines) + "\n\nStages of the run recorded before this export; grid intensity "
            f"{last['grid_gco2e_per_kwh']:g} gCO2e/kWh. Method: {last['method']}. Prices: {last['prices']}.")


# ------------------------------------------------------------------------------ planning


def plan_energy(gpu_hours: float, gpu: str, tdp_w: float | None, energy: EnergyConfig | None = None) -> dict:
    """Energy and CO2e of a planned run: its GPU-hours at the board's TDP (`energy.gpu_tdp_w`, else
    `tdp_w`, the plan.gpus entry's), the same grid intensity as the measured runs; host CPUs, memory
    and cooling aside."""
    energy = energy or EnergyConfig()
    tdp = energy.gpu_tdp_w or tdp_w
    if tdp is None:
        return {"energy_kwh": None, "co2e_kg": None, "gpu_tdp_w": None,
                "energy_assumption": f"no TDP known for {gpu!r}: set plan.gpus.{gpu}.tdp_w or energy.gpu_tdp_w"}
    kwh = gpu_hours * tdp / 1000.0
    return {"energy_kwh": kwh, "co2e_kg": co2e_kg(kwh, energy), "gpu_tdp_w": tdp,
            "energy_assumption": f"energy = gpu_hours x {tdp:g} W board TDP (the boards at TDP while training; "
                                 "host CPUs, memory and cooling not counted); CO2e at "
                                 f"{energy.grid_gco2e_per_kwh:g} gCO2e/kWh (energy.grid_gco2e_per_kwh)"}
