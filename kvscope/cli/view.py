"""``kvscope view``: the attention explorer, served or written as one page."""

from __future__ import annotations

from ..errors import KvscopeError
from .common import human_bytes


def add_view(sub) -> None:
    p = sub.add_parser("view", help="the attention explorer in the browser (served, or one HTML page)")
    p.add_argument("store", help="a trace store")
    p.add_argument("--replay", default=None, metavar="RESULT", help="a replay result of this trace: policy overlays")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: a free one)")
    p.add_argument("--html", default=None, metavar="FILE", help="write one self-contained page instead of serving")
    p.add_argument(
        "--tokens", choices=("model", "ids"), default="model", help="token text from the model's tokenizer, or ids"
    )
    p.set_defaults(func=cmd_view)


def cmd_view(args) -> int:
    from ..replay import open_result
    from ..storage.paths import output_path
    from ..storage.store import open_trace

    if not 0 <= args.port <= 65535:
        raise KvscopeError(f"--port {args.port} is not a port (0..65535; 0 takes a free one)")
    html = output_path(args.html, "--html", file=True) if args.html else None
    if html is not None and (html.is_dir() or html.suffix.lower() not in (".html", ".htm")):
        raise KvscopeError(f"--html {html}: name a file ending in .html")
    ds = open_trace(args.store)
    result = open_result(args.replay) if args.replay else None
    where = f"--replay {args.replay}"
    if html is not None:
        from ..explorer import write_html

        info = write_html(ds, result, html, tokens=args.tokens, where=where)
        rows, cols = info["cells"]
        print(f"wrote {html} ({human_bytes(info['bytes'])}; {info['images']} images of {rows} × {cols} cells)")
        return 0
    return _serve(args, ds, result, where)


def _serve(args, ds, result, where: str) -> int:
    from ..explorer import serve

    server = serve(ds, result, host=args.host, port=args.port, tokens=args.tokens, where=where)
    server.start()
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"kvscope view: http://{host}:{server.port}/  (Ctrl-C stops it)", flush=True)
    try:
        server.io_loop.start()
    except KeyboardInterrupt:
        pass
    return 0
