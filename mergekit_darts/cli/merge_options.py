"""mergekit's merge options for ``mergekit-darts run``, declared without importing mergekit.

``mergekit.options`` imports torch, transformers and peft (about ten seconds on a small machine), so
building ``run`` from its ``add_merge_options`` made every ``--help`` slow. The same options are
declared here from a table, in mergekit's order, with its help texts, defaults and help categories;
``MergeOptions`` itself is built from them only when the command runs. ``tests/test_startup.py``
compares these options and the rendered ``--help`` with mergekit's own, so a mergekit release that
adds or changes an option fails the tests instead of drifting.
"""

import functools
from typing import Any, Callable, Optional

import click

# (field, type, default) in the order of mergekit.options.MergeOptions.model_fields
FIELDS = (
    ("allow_crimes", bool, False),
    ("unsafe_truncate_embeddings", bool, False),
    ("transformers_cache", str, None),
    ("lora_merge_cache", str, None),
    ("lora_merge_dtype", str, None),
    ("cuda", bool, False),
    ("device", str, None),
    ("low_cpu_memory", bool, False),
    ("out_shard_size", "size", 5_000_000_000),
    ("copy_tokenizer", bool, True),
    ("clone_tensors", bool, False),
    ("trust_remote_code", bool, False),
    ("random_seed", int, None),
    ("lazy_unpickle", bool, False),
    ("write_model_card", bool, True),
    ("safe_serialization", bool, True),
    ("verbosity", int, 0),
    ("quiet", bool, False),
    ("read_to_gpu", bool, False),
    ("multi_gpu", bool, False),
    ("num_threads", int, None),
    ("gpu_rich", bool, False),
    ("async_write", bool, False),
    ("write_threads", int, 1),
)

# mergekit.options.OPTION_HELP
OPTION_HELP = {
    "allow_crimes": "Allow mixing architectures",
    "unsafe_truncate_embeddings": "UNSAFE: discard trailing embedding rows to match the smallest vocabulary. "
                                  "Assumes identical token IDs; use tokenizer configuration instead.",
    "transformers_cache": "Override storage path for downloaded models",
    "lora_merge_cache": "Path to store merged LORA models",
    "lora_merge_dtype": "Override dtype when applying LoRAs",
    "cuda": "Perform matrix arithmetic on GPU",
    "device": "Perform matrix arithmetic on specified device",
    "low_cpu_memory": "Store results and intermediate values on accelerator. Useful if VRAM > RAM",
    "out_shard_size": "Number of parameters per output shard  [default: 5B]",
    "copy_tokenizer": "Copy a tokenizer to the output",
    "clone_tensors": "Clone tensors before saving, to allow multiple occurrences of the same layer",
    "trust_remote_code": "Trust remote code from huggingface repos (danger)",
    "random_seed": "Seed for reproducible use of randomized merge methods",
    "lazy_unpickle": "Experimental lazy unpickler for lower memory usage",
    "write_model_card": "Output README.md containing details of the merge",
    "safe_serialization": "Save output in safetensors. Do this, don't poison the world with more pickled models.",
    "quiet": "Suppress progress bars and other non-essential output",
    "read_to_gpu": "Read model weights directly to accelerator",
    "multi_gpu": "Use multi-gpu parallel graph execution engine",
    "num_threads": "Number of threads to use for parallel CPU operations",
    "verbosity": "Verbose logging (repeat for more verbosity)",
    "gpu_rich": "Alias for --cuda --low-cpu-memory --read-to-gpu --multi-gpu",
    "async_write": "Write output shards asynchronously (faster execution, higher memory use)",
    "write_threads": "Number of threads to use for asynchronous writes",
}

# mergekit.options.OPTION_CATEGORIES
OPTION_CATEGORIES = {
    "lora_merge_cache": "Storage",
    "transformers_cache": "Storage",
    "out_shard_size": "Output Settings",
    "copy_tokenizer": "Output Settings",
    "clone_tensors": "Output Settings",
    "write_model_card": "Output Settings",
    "safe_serialization": "Output Settings",
    "lazy_unpickle": "Performance",
    "cuda": "Performance",
    "device": "Performance",
    "low_cpu_memory": "Performance",
    "read_to_gpu": "Performance",
    "multi_gpu": "Performance",
    "num_threads": "Performance",
    "gpu_rich": "Performance",
    "trust_remote_code": "Dangerous Options",
    "allow_crimes": "Dangerous Options",
    "unsafe_truncate_embeddings": "Dangerous Options",
    "random_seed": "Miscellaneous",
    "verbosity": "Miscellaneous",
    "quiet": "Miscellaneous",
    "lora_merge_dtype": "Miscellaneous",
    "async_write": "Performance",
    "write_threads": "Performance",
}


def parse_kmb(value) -> int:
    """mergekit.common.parse_kmb: ``5B`` / ``500M`` / ``10k`` / a plain number of parameters."""
    if isinstance(value, int):
        return value
    if value.isnumeric():
        return int(value)
    scale = {"k": 1000, "m": 1000 ** 2, "b": 1000 ** 3}.get(value[-1:].lower())
    if scale is None or not value[:-1].isnumeric():
        raise ValueError(value)
    return int(value[:-1]) * scale


class ShardSizeParamType(click.ParamType):
    name = "size"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> int:
        try:
            return parse_kmb(value)
        except (ValueError, IndexError, AttributeError):
            self.fail(f"{value!r} is not a parameter count (e.g. 5B, 500M, 10k)", param, ctx)


def add_merge_options(f: Callable) -> Callable:
    """mergekit.options.add_merge_options, without importing mergekit until the command runs."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        from mergekit.options import MergeOptions

        arg_dict = {name: kwargs.pop(name) for name, _, _ in FIELDS if name in kwargs}
        kwargs["merge_options"] = MergeOptions(**arg_dict)
        return f(*args, **kwargs)

    for field_name, field_type, default in reversed(FIELDS):
        if field_type == "size":
            field_type = ShardSizeParamType()
        arg_name = field_name.replace("_", "-")
        param_decls = [f"--{arg_name}/--no-{arg_name}" if field_type is bool else f"--{arg_name}"]
        extra = {}
        if field_name == "verbosity":
            param_decls = ["-v", "verbosity"]
            extra["count"] = True
        if field_name == "num_threads":
            param_decls = ["--num-threads", "-j"]
        if field_name == "gpu_rich":
            param_decls = ["--gpu-rich"]
            extra["is_flag"] = True
        wrapper = click.option(*param_decls, type=field_type, default=default, help=OPTION_HELP.get(field_name),
                               show_default=field_name not in ("out_shard_size", "verbosity"), **extra)(wrapper)
    return wrapper


class PrettyPrintHelp(click.Command):
    """mergekit.options.PrettyPrintHelp: options grouped under mergekit's category headings."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        categories = {None: []}
        for param in ctx.command.params:
            categories.setdefault(OPTION_CATEGORIES.get(param.name), []).append(param)
        for category, params in categories.items():
            records = [r for r in (p.get_help_record(ctx) for p in params) if r is not None]
            if records:
                with formatter.section(category or "Script Options"):
                    formatter.write_dl(records)
