"""Fixtures of the chart tests: the chart loaded once into the embedded Helm engine, its renders
per value set, and the real command-line parsers of the programs the chart starts."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator

import helm_python as helm
import pytest
from chart_harness import CHART_DIR, Rendered, load_value_set, render

from trainer_svc.cli import build_parser


def _exact(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser, refusing abbreviations: a flag must exist as written, not as a prefix."""
    parser.allow_abbrev = False
    return parser


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def rendered_set(chart: helm.Chart) -> Callable[[str], Rendered]:
    """Renders a named value set ("default" or a ci/ file) once per session."""
    cache: dict[str, Rendered] = {}

    def get(name: str) -> Rendered:
        if name not in cache:
            cache[name] = render(chart, load_value_set(name))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's own parser (torch.distributed.run), the console script the trainer pods run."""
    from torch.distributed.run import get_args_parser

    return _exact(get_args_parser())


@pytest.fixture(scope="session")
def trainer_parser() -> argparse.ArgumentParser:
    """The trainer's parser: `python -m trainer_svc` parses its flags with this."""
    return _exact(build_parser())


@pytest.fixture(scope="session")
def vllm_cli() -> tuple[argparse.ArgumentParser, Callable[[argparse.Namespace], None]]:
    """The `vllm` parser with its `serve` subcommand, built the way vllm.entrypoints.cli.main does,
    and the subcommand's own validation. Importing vLLM takes a few seconds, once per session."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    serve = ServeSubcommand()
    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    _exact(serve.subparser_init(subparsers))
    return parser, serve.validate
