"""The output: nccl-tests' table on stdout, column for column, plus JSON, CSV and a PNG plot."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "COLUMNS",
    "Measure",
    "avg_busbw",
    "Row",
    "device_line",
    "footer",
    "format_row",
    "header_line",
    "titles",
    "write_csv",
    "write_json",
    "write_plot",
]


@dataclass(frozen=True, slots=True)
class Measure:
    """One timed half of a row (out-of-place or in-place)."""

    time_us: float
    algbw: float  # GB/s, 1e9 bytes
    busbw: float
    wrong: int | None  # None: not checked ("N/A")


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the table: a size of one collective, type, reduction and root."""

    collective: str
    size: int
    count: int
    type: str
    redop: str
    root: int
    oop: Measure
    ip: Measure

    def flat(self) -> dict[str, Any]:
        """The row as one flat dict, keys in ``COLUMNS`` order (JSON and CSV)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("oop", "ip")}
        for prefix, m in (("oop", self.oop), ("ip", self.ip)):
            out.update({f"{prefix}_{k}": v for k, v in asdict(m).items()})
        return out

    @classmethod
    def from_flat(cls, d: dict[str, Any]) -> Row:
        """The row back from :meth:`flat`'s dict (e.g. read from ``--json``), to format or plot again."""
        halves = [Measure(*(d[f"{p}_{k}"] for k in ("time_us", "algbw", "busbw", "wrong"))) for p in ("oop", "ip")]
        return cls(*(d[k] for k in COLUMNS[:6]), *halves)


#: JSON/CSV columns: the table's, in its order, with oop_/ip_ for out-of-place and in-place.
COLUMNS = [
    *("collective", "size", "count", "type", "redop", "root"),
    *("oop_time_us", "oop_algbw", "oop_busbw", "oop_wrong"),
    *("ip_time_us", "ip_algbw", "ip_busbw", "ip_wrong"),
]


def header_line(
    minbytes: int, maxbytes: int, stepfactor: int, stepbytes: int, warmup: int, iters: int, check: int
) -> str:
    """nccl-tests' first line: the run's parameters."""
    step = f"{stepfactor}(factor)" if stepfactor > 1 else f"{stepbytes}(bytes)"
    return (
        f"# nThread 1 nGpus 1 minBytes {minbytes} maxBytes {maxbytes} step: {step} warmup iters: {warmup} "
        f"iters: {iters} agg iters: 1 validation: {check} graph: 0"
    )


def device_line(rank: int, pid: int, host: str, device: int, bus: int, name: str) -> str:
    """One "# Using devices" line (Group is always 0: one communicator)."""
    return f"#  Rank {rank:2d} Group {0:2d} Pid {pid:6d} on {host:>10s} device {device:2d} [0x{bus:02x}] {name}"


def titles() -> list[str]:
    """The three column-title lines, exactly nccl-tests' (trailing blanks dropped)."""
    key = ("", "", "", "", "")
    names = ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong")
    units = ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "")
    lead = "# {:>10s}  {:>12s}  {:>8s}  {:>6s}  {:>6s}"
    return [
        (lead.format(*key) + "           out-of-place                       in-place").rstrip(),
        (lead + "  {:>7s}  {:>6s}  {:>6s} {:>6s}" * 2).format(*names, *names[5:]).rstrip(),
        (lead + "  {:>7s}  {:>6s}  {:>6s}  {:>5s}" * 2).format(*units, *units[5:]).rstrip(),
    ]


def _time(us: float) -> str:
    """nccl-tests' time column: fewer decimals as the number grows, always 7 wide."""
    if us >= 10000.0:
        return f"{us:7.0f}"
    return f"{us:7.1f}" if us >= 100.0 else f"{us:7.2f}"


def format_row(row: Row) -> str:
    """One table line: "%12li  %12li  %8s  %6s  %6i" then, twice, "  %7s  %6.2f  %6.2f  %5s"."""
    line = f"{row.size:12d}  {row.count:12d}  {row.type:>8s}  {row.redop:>6s}  {row.root:6d}"
    for m in (row.oop, row.ip):
        wrong = "N/A" if m.wrong is None else str(m.wrong)
        line += f"  {_time(m.time_us)}  {m.algbw:6.2f}  {m.busbw:6.2f}  {wrong:>5s}"
    return line


def footer(errors: int, avg_busbw: float) -> list[str]:
    """nccl-tests' closing lines: measurements with wrong values (summed over ranks), mean busbw."""
    return [
        f"# Out of bounds values : {errors} {'FAILED' if errors else 'OK'}",
        f"# Avg bus bandwidth    : {avg_busbw:g}",
        "#",
    ]


def avg_busbw(rows: Sequence[Row]) -> float:
    """The mean busbw over every measurement, out-of-place and in-place (nccl-tests' average)."""
    values = [m.busbw for r in rows for m in (r.oop, r.ip)]
    return sum(values) / len(values) if values else 0.0


def write_json(path: str, meta: dict[str, Any], rows: Iterable[Row], sections: list[dict[str, Any]]) -> None:
    """``meta`` (run parameters, devices), every row, and each collective's footer values."""
    doc = {**meta, "columns": COLUMNS, "rows": [r.flat() for r in rows], "sections": sections}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")


def write_csv(path: str, rows: Iterable[Row]) -> None:
    """One header line (``COLUMNS``), then one line per row; unchecked #wrong is written N/A."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for r in rows:
            writer.writerow(["N/A" if v is None else v for v in r.flat().values()])


def _series(rows: Iterable[Row]) -> dict[str, list[Row]]:
    """Rows grouped into one plotted line per collective (and type, op, root when a run has several)."""
    rows = list(rows)
    varies = {
        (c, k)
        for c in {r.collective for r in rows}
        for k in ("type", "redop", "root")
        if len({getattr(r, k) for r in rows if r.collective == c}) > 1
    }
    out: dict[str, list[Row]] = {}
    for r in rows:
        extra = [f"{k}={getattr(r, k)}" for k in ("type", "redop", "root") if (r.collective, k) in varies]
        out.setdefault(" ".join([r.collective, *extra]), []).append(r)
    return out


def write_plot(path: str, rows: Iterable[Row], title: str) -> None:
    """busbw against size (log axis): out-of-place solid, in-place dashed, one colour per collective."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none wanted
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, series in _series(rows).items():
        sizes = [r.size for r in series if r.size > 0]
        (line,) = ax.plot(sizes, [r.oop.busbw for r in series if r.size > 0], marker="o", ms=3, label=label)
        ax.plot(sizes, [r.ip.busbw for r in series if r.size > 0], ls="--", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s); dashed: in-place")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
