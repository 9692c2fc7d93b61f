"""`localllm worker`: serve this machine's compute device to `localllm serve --rpc` over llama.cpp's RPC."""

from __future__ import annotations

import click

from localllm.cli import Setting

SECURITY = ("llama.cpp RPC has no authentication and no encryption: anyone who can reach this port can allocate "
            "memory and run computations here. Bind it to 127.0.0.1, or to an address of a trusted network only.")


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback by default).")
@click.option("--port", type=Setting("port"), default=50052, show_default=True, help="Port to listen on.")
@click.option("--threads", type=Setting("threads"), help="CPU threads for the work (default: half the cores).")
@click.option("--cache", "cache_dir", type=click.Path(file_okay=False), help="Keep tensors sent by clients in this "
              "folder, so a model's weights cross the network once (llama.cpp's rpc-server -c).")
def worker(host: str, port: int, threads: int | None, cache_dir: str | None) -> None:
    """Serve this machine's GPU (or CPU) to a `localllm serve --rpc HOST:PORT` elsewhere.

    \b
    Example (two machines; the second runs the server):
      gpu-box$ localllm worker --host 192.168.1.20 --port 50052
      laptop$  localllm serve --rpc 192.168.1.20:50052

    Needs a llama.cpp build with RPC (bash native/build.sh rpc; `localllm doctor` says whether this one has it).
    One client at a time: a second server waits until the first disconnects.
    """
    from localllm.config import valid_host
    from localllm.runtime.native import rpc

    if not valid_host(host) or ":" in host:
        raise click.BadParameter(f"{host!r} is not a host name or IPv4 address (llama.cpp's RPC has no IPv6)",
                                 param_hint="--host")
    rpc.require()
    click.secho(f"warning: {SECURITY}", fg="yellow", err=True)
    if host not in ("127.0.0.1", "localhost", "::1"):
        click.secho(f"listening on {host}, which is not loopback: every machine that reaches it can use it",
                    fg="yellow", err=True)
    click.echo(f"localllm RPC worker on {host}:{port} (Ctrl+C stops it)", err=True)
    try:
        rpc.serve(host, port, threads=threads, cache_dir=cache_dir)
    except KeyboardInterrupt:
        click.echo("stopped", err=True)
