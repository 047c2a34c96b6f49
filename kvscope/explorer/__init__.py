"""The attention explorer (docs/explorer.md): step × position heatmaps read a view at a time,
policy tiers over them, the per-layer views beside them.

    kvscope.view(ds, result)                       the app in Jupyter (a Panel object)
    serve(ds, result, port=0)                      a Bokeh server through Panel; returns it
    write_html(ds, result, "page.html")            one self-contained page (aggregated)

Panel serves and embeds; the figures are Bokeh's (``kvscope.explorer.figures``).
"""

from __future__ import annotations

from typing import Any

import xarray as xr

from .app import Explorer, load, title_of
from .static import write_html


def view(ds: xr.Dataset, result: xr.Dataset | None = None, *, tokens: str = "model", title: str = ""):
    """The explorer of a trace (``kvscope.open_trace``) and optionally its replay result
    (``kvscope.open_result``) as a Panel object: displayed by Jupyter, served by ``.servable()``."""
    import panel as pn

    shared = load(ds, result, tokens=tokens)
    app = Explorer(shared, title=title or title_of(ds))
    if pn.state.curdoc is not None:  # inside a server session (``.servable()``)
        app.fill_side_later(pn.state.curdoc)
    else:  # Jupyter: the numbers are there when the cell's output is
        app.fill_side()
    return pn.pane.Bokeh(app.layout)


def serve(
    ds: xr.Dataset,
    result: xr.Dataset | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    tokens: str = "model",
    title: str = "",
    where: str = "the replay result",
) -> Any:
    """Start a server (not blocking) whose every session is an explorer of the same trace
    (``kvscope view``).

    Args:
        ds: A trace.
        result: A replay result of that trace: its policies' tiers are overlaid.
        host: The address to listen on.
        port: The port (0: a free one).
        tokens: How a token is labelled: ``model`` (its text) or ``ids``.
        title: The page's title (default: the store and its model).
        where: How messages name ``result``.

    Returns:
        The Bokeh server (``server.port``), started with ``server.start()``.
    """
    import panel as pn

    port = listen_port(host, port)  # a busy port is refused before anything is read
    shared = load(ds, result, where, tokens)
    label = title or title_of(ds)

    def session():
        app = Explorer(shared, title=label)
        app.fill_side_later(pn.state.curdoc)
        return pn.pane.Bokeh(app.layout)

    names = {host, "127.0.0.1", "localhost"} if host not in ("0.0.0.0", "::") else {"*"}
    origins = sorted(n if n == "*" else f"{n}:{port}" for n in names)
    return pn.serve(
        {"/": session},
        address=host,
        port=port,
        show=False,
        start=False,
        threaded=False,
        websocket_origin=origins,
        title="kvscope view",
        verbose=False,
    )


def listen_port(host: str, port: int) -> int:
    """``port`` if it can be listened on at ``host`` now — a free one for 0 (the server binds it
    right after) — else one line naming it."""
    import socket

    from ..errors import KvscopeError

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise KvscopeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        return probe.getsockname()[1]


__all__ = ["Explorer", "serve", "view", "write_html"]
