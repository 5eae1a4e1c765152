"""``mergekit-darts serve``: OUT's router in front of llama-server (docs/serving.md#routed-serving)."""

import click

STATES_HELP = ("Where the router's prompt states come from: embeddings (OUT's embedding rows; a router on the "
               "token embeddings), engine (an embeddings llama-server on the base GGUF: --states-engine), local "
               "(OUT in transformers on this machine). Default: the cheapest exact one for OUT's router.")


def _adapter_map(values) -> dict:
    mapping = {}
    for value in values:
        domain, sep, index = value.partition("=")
        if not sep or not index.isdigit():
            raise click.BadParameter(f"{value!r}: expected DOMAIN=ID (an id from the engine's GET /lora-adapters)",
                                     param_hint="--adapter")
        mapping[domain] = int(index)
    return mapping


@click.command("serve")
@click.argument("out_path", metavar="OUT_PATH")
@click.option("--engine", required=True, help="llama-server URL, started with --lora lora-<domain>.gguf for each "
              "domain and --lora-init-without-apply (e.g. http://127.0.0.1:8080).")
@click.option("--states", type=click.Choice(["embeddings", "engine", "local"]), default=None, help=STATES_HELP)
@click.option("--states-engine", default=None, help="URL of a llama-server started with --embeddings --pooling mean "
              "on the same base GGUF (for a router on the final states).")
@click.option("--adapter", "adapters", multiple=True, metavar="DOMAIN=ID",
              help="The engine's adapter id of a domain, when its file is not named lora-<domain>.gguf.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (localhost only by "
              "default; 0.0.0.0 exposes it to the network).")
@click.option("--port", default=8090, show_default=True, type=click.IntRange(0, 65535))
def serve_command(out_path, engine, states, states_engine, adapters, host, port):
    """Route each OpenAI-style request to OUT_PATH's domain and forward it to llama-server.

    \b
    OUT_PATH  a repaired directory with a router (its tokenizer and router are read; no weights but
              the embedding rows, unless --states local)
    """
    from transformers import AutoTokenizer

    from mergekit_darts.output.check import check_output_dir
    from mergekit_darts.serving.proxy import RoutedProxy, engine_adapters, serve
    from mergekit_darts.serving.states import Router

    check_output_dir(out_path)
    router = Router(out_path, states, states_engine)
    try:
        mapping = engine_adapters(engine, list(router.domains), _adapter_map(adapters))
    except OSError as error:
        raise click.ClickException(f"--engine {engine}: unreachable ({error}); start llama-server first") from None
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    proxy = RoutedProxy(router, AutoTokenizer.from_pretrained(out_path), engine, mapping)
    server = serve(proxy, host, port)
    click.echo(f"Routing {', '.join(router.domains)} (states: {router.source}; adapters {mapping}) to {engine} "
               f"on http://{host}:{server.server_address[1]}")
    try:
        server.serve_forever()
    finally:
        server.server_close()
        click.echo("Requests per domain: " + (", ".join(f"{k} {v}" for k, v in sorted(proxy.counts.items())) or "none"))
