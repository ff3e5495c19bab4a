"""The `dfserve` command: a Click root that mounts each component's commands, importing them only when used.

Heavy imports (torch for conversion, the simulator's tokenizer) load only in the command that needs them, so
`dfserve --help` stays instant. A `UserError` anywhere becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from dfserve import __version__
from dfserve.errors import UserError

# name -> ("module:attribute", one-line purpose shown by --help without importing the module)
COMMANDS: dict[str, tuple[str, str]] = {
    "deploy": ("dfserve.deploy.cli:deploy", "Put a drafter (zlab, a checkpoint, or the baseline) behind SGLang, the simulator or k8s."),
    "sim": ("dfserve.deploy.sim.cli:sim", "Serve the simulated SGLang engine (same HTTP API, modelled acceptance and latency)."),
    "gateway": ("dfserve.gateway.cli:gateway", "Split or mirror live OpenAI/SGLang traffic between drafter arms and measure each."),
    "loadtest": ("dfserve.loadtest.cli:loadtest", "Replay coding tasks against all arms at once; record per-request acceptance and latency."),
    "eval": ("dfserve.eval.cli:eval_group", "Screen drafters offline: τ on cached target features, paired verdicts (needs dfserve[eval])."),
    "compare": ("dfserve.loadtest.cli:compare", "Judge a candidate against a baseline: paired statistics, losslessness, gate, verdict."),
    "promote": ("dfserve.loadtest.cli:promote", "Make a PASSed candidate the new baseline (history kept)."),
    "baseline": ("dfserve.loadtest.cli:baseline", "Show the current baseline and its history."),
    "demo": ("dfserve.demo:demo", "Run a whole A/B judgement on simulated engines, end to end."),
    "dashboards": ("dfserve.dashboards.cli:dashboards", "Write the Grafana dashboards, Prometheus rules and their k8s objects."),
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        target, _ = COMMANDS[cmd_name]
        module_name, attribute = target.split(":")
        command = getattr(importlib.import_module(module_name), attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"{target} is not a click command")
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, purpose) for name, (_, purpose) in COMMANDS.items()])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
@click.version_option(__version__, prog_name="dfserve")
def root() -> None:
    """Deploy DFlash drafters behind SGLang and judge them online before they replace the baseline."""


def main(argv: list[str] | None = None) -> None:
    try:
        status = root.main(args=argv, prog_name="dfserve", standalone_mode=False)
        if isinstance(status, int):  # click returns a command's `Exit(code)` here instead of exiting
            sys.exit(status)
    except click.exceptions.Abort:
        click.echo("dfserve: aborted", err=True)
        sys.exit(130)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except UserError as exc:
        click.echo(f"dfserve: error: {exc}", err=True)
        sys.exit(2)
    except BrokenPipeError:  # the reader stopped early (`| head`): 141, as a shell says of SIGPIPE, never a verdict's
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except OSError as exc:  # a path or socket the user named: one line, and never exit 1 (FAIL for `compare`)
        where = f"{exc.filename}: " if exc.filename else ""
        click.echo(f"dfserve: error: {where}{exc.strerror or exc}", err=True)
        sys.exit(2)
