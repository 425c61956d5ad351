"""Draw docs/layers.svg from the layers pyproject.toml declares to import-linter: one band per
layer, top to bottom, its modules side by side, and the path a collective takes through them
down the right-hand side. ``python docs/layers.py`` rewrites the file;
tests/unit/test_layers.py checks that it is current."""

from __future__ import annotations

import pathlib
import sys
from html import escape

if sys.version_info >= (3, 11):
    import tomllib
else:  # the test extra brings tomli there
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "layers.svg"

# What each layer does for one allreduce (the right-hand column), by its first module.
PATH = {
    "ddlcore.bootstrap": "comm.allreduce(x): checked, numbered",
    "ddlcore.execution": "the first path that takes it runs it",
    "ddlcore.job": "the links: a transport per peer pair",
    "ddlcore.calls": "the call described; the flight recorder",
    "ddlcore.planning": "the cost model picks the algorithm",
    "ddlcore.algorithms": "this rank's schedule: plain data",
    "ddlcore.topology": "the box and its links",
    "ddlcore.buffers": "x becomes a descriptor",
    "ddlcore.transports": "send / recv, tag-matched",
    "ddlcore.kernels": "reduce the chunks",
}

_WIDTH, _BAND, _GAP, _LEFT, _PATH_X = 980, 34, 6, 10, 660


def layers() -> list[list[str]]:
    """pyproject.toml's layers, top to bottom, each a list of its modules."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (declared,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    return [[m.strip() for m in layer.replace("|", ":").split(":")] for layer in declared]


def svg() -> str:
    rows = layers()
    height = len(rows) * (_BAND + _GAP) + 50
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" '
        f'viewBox="0 0 {_WIDTH} {height}" font-family="DejaVu Sans, Arial, sans-serif" '
        'font-size="12">',
        f'<rect width="{_WIDTH}" height="{height}" fill="white"/>',
        f'<text x="{_LEFT}" y="20" font-size="14" font-weight="bold">ddlcore: layers (imports '
        "point down only), and an allreduce's way through them</text>",
    ]
    y = 34
    last_path_y = None
    for modules in rows:
        share = (_PATH_X - _LEFT - 20) / len(modules)
        for i, module in enumerate(modules):
            x = _LEFT + i * share
            name = module.removeprefix("ddlcore.")
            out.append(
                f'<rect x="{x:.1f}" y="{y}" width="{share - 4:.1f}" height="{_BAND}" rx="4" '
                'fill="#e8eef7" stroke="#4a6fa5"/>'
            )
            out.append(
                f'<text x="{x + (share - 4) / 2:.1f}" y="{y + _BAND / 2 + 4}" '
                f'text-anchor="middle">{escape(name)}</text>'
            )
        step = PATH.get(modules[0])
        if step is not None:
            mid = y + _BAND / 2
            out.append(f'<circle cx="{_PATH_X}" cy="{mid}" r="4" fill="#c0392b"/>')
            out.append(f'<text x="{_PATH_X + 10}" y="{mid + 4}">{escape(step)}</text>')
            if last_path_y is not None:
                out.append(
                    f'<line x1="{_PATH_X}" y1="{last_path_y + 4}" x2="{_PATH_X}" '
                    f'y2="{mid - 4}" stroke="#c0392b" stroke-width="2"/>'
                )
            last_path_y = mid
        y += _BAND + _GAP
    out.append("</svg>")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    OUT.write_text(svg())
    print(f"wrote {OUT.relative_to(ROOT)}")
