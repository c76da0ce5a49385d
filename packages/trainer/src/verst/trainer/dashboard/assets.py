"""The page and its assets: `static/` (shipped as package data) and plotly.js from the plotly package.

The curves and the trajectory chart are drawn by plotly.js, which the `plotly` Python package
ships as `plotly/package_data/plotly.min.js`; the page loads it from this server (or, in a
report, evaluates its inert inline copy) the first time such a chart is drawn, never from a CDN.
The timeline draws its own SVG, so the page's first view never waits for plotly.js.
"""

from __future__ import annotations

import functools
import importlib.util
from importlib import resources
from pathlib import Path

from verst.rollout.errors import MissingOptionalDependency

PAGE_ASSETS = ("curves.js", "timeline.js", "trajectory.js", "compare.js", "app.js", "style.css")
"""Files of `static/` the page loads besides plotly.min.js."""
PLOTLY_JS = "plotly.min.js"
_SCRIPTS = ("curves.js", "timeline.js", "trajectory.js", "compare.js", "app.js")
"""The page's scripts in load order (app.js starts the page; the others define its views)."""
PLOTLY_SOURCE_ID = "plotly-src"
"""The id of the report's inert copy of plotly.js, evaluated when a chart first needs it."""


def asset_names() -> tuple[str, ...]:
    """Every name `/static/<name>` serves."""
    return (*PAGE_ASSETS, PLOTLY_JS)


@functools.cache
def plotly_js_path() -> Path:
    """plotly.min.js inside the installed plotly package (found without importing plotly)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise MissingOptionalDependency(
            "verst dashboard draws its charts with plotly.js from the plotly package, which is not "
            "installed; install it with `uv sync` (it is a verst-trainer dependency) or `pip install plotly`"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "package_data" / PLOTLY_JS
        if path.is_file():
            return path
    raise MissingOptionalDependency(
        f"the installed plotly package has no package_data/{PLOTLY_JS}; reinstall it (`uv sync --reinstall-package plotly`)"
    )


@functools.cache
def asset_bytes(name: str) -> bytes:
    """The bytes of one asset (cached)."""
    if name == PLOTLY_JS:
        return plotly_js_path().read_bytes()
    if name not in PAGE_ASSETS:
        raise KeyError(name)
    return (resources.files("verst.trainer.dashboard") / "static" / name).read_bytes()


def page_html(*, inline: bool = False, data_json: str | None = None, title: str = "verst dashboard") -> str:
    """The page: assets linked from /static (served) or inlined with the data (a report)."""
    template = (resources.files("verst.trainer.dashboard") / "static" / "index.html").read_text("utf-8")
    if inline:

        def script(name: str) -> str:
            return "<script>" + _safe(asset_bytes(name).decode("utf-8")) + "</script>"

        head = "<style>" + asset_bytes("style.css").decode("utf-8") + "</style>"
        body = (
            f'<script id="{PLOTLY_SOURCE_ID}" type="text/plain">'
            + _safe(asset_bytes(PLOTLY_JS).decode("utf-8"))
            + "</script>\n"
            + f'<script id="verst-data" type="application/json">{_safe(data_json or "{}")}</script>\n'
            + "\n".join(script(name) for name in _SCRIPTS)
        )
    else:
        # plotly.js is not linked: the page loads it when a chart first needs it (app.js `plotly()`)
        head = '<link rel="stylesheet" href="static/style.css">'
        body = "\n".join(f'<script src="static/{name}"></script>' for name in _SCRIPTS)
    return template.replace("{{TITLE}}", title).replace("{{HEAD}}", head).replace("{{BODY}}", body)


def _safe(text: str) -> str:
    """Text that cannot end the <script> element it is inlined into."""
    return text.replace("</script", "<\\/script").replace("<!--", "<\\!--")
