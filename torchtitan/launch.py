"""One process that checks a job, then starts and watches its workers on this node (run_train.sh
runs it; so does scripts/multinode_trainer.slurm on every node).

    python -m torchtitan.launch --nproc-per-node 2 [--nnodes 2 --rdzv-endpoint HOST:PORT ...] \\
        -- --job.config_file train_configs/debug_model.toml [config overrides]

1. Preflight (torchtitan.preflight.check) in this process: a mistake is one line on stderr and exit
   status 2 before any worker exists. --help prints the options and exits 0.
2. torchrun in this process: torch.distributed.run's parser and launch config, the elastic agent,
   c10d rendezvous (several nodes), --max-restarts, tee'd logs of --log-rank.
3. The workers. On a machine without CUDA they are forked from this process (`--worker-start fork`):
   torch and the trainer were imported once, by the preflight, so a worker starts in milliseconds
   instead of importing torch again. With CUDA they run as `python -m torchtitan.train` (`exec`):
   a CUDA context does not survive fork. Either way a worker runs torchtitan.train.main.
4. Outcome: a worker that ended with a user mistake (exit status 2, message printed by the ranks)
   ends the launcher with 2 and nothing more; any other failure prints one line naming the rank,
   its exit status or signal and its log file, and the launcher exits non-zero. A rendezvous that
   does not complete (unreachable endpoint, missing nodes) ends with one line within
   --rdzv-timeout seconds.
"""

import io
import os
import signal
import sys
from typing import cast

STOPPED_EARLY = "stopped: Ctrl-C before training started; no worker was launched"


def _stopped_early(signum, frame):
    print(STOPPED_EARLY, file=sys.stderr, flush=True)
    os._exit(128 + signal.SIGINT)


if __name__ == "__main__":
    # Ctrl-C while the launcher imports and checks the job (seconds): one line, not a KeyboardInterrupt traceback
    # from wherever the import was. Set before the imports below; main() hands SIGINT back before the workers start.
    signal.signal(signal.SIGINT, _stopped_early)

import argparse  # noqa: E402
import gc  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

from torchtitan.config import HelpRequested, UserError  # noqa: E402
from torchtitan.config.errors import run_main  # noqa: E402

# Threads a fresh process would use (torch's default intra-op count), read before the launcher
# limits itself to one; a forked worker without OMP_NUM_THREADS restores it.
_default_threads: int | None = None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchtitan.launch",
        description="Check a training job, then start its workers with torchrun (options before '--', "
        "config overrides after it).",
        allow_abbrev=False,
    )
    p.add_argument("--nproc-per-node", type=int, default=1, help="workers on this node (GPUs, or CPU processes)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job")
    p.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this node's rank (optional with c10d rendezvous; 0 hosts the rendezvous store and checks "
        "the dump folder's lock)",
    )
    p.add_argument(
        "--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous store (node 0); required with --nnodes > 1"
    )
    p.add_argument("--rdzv-id", default="torchtitan", help="rendezvous id, the same on every node of a job")
    p.add_argument(
        "--rdzv-timeout",
        type=int,
        default=600,
        help="seconds to wait for node 0's rendezvous store to answer and for all nodes to join",
    )
    p.add_argument("--max-restarts", type=int, default=0, help="restarts of the worker group after a failure")
    p.add_argument("--log-rank", default="0", help="comma list of local ranks whose output is shown")
    p.add_argument("--log-dir", default=None, help="folder for every worker's stdout/stderr (default: a temp folder)")
    p.add_argument(
        "--lighthouse-port",
        type=int,
        default=None,
        help="replica groups on one machine: start a torchft lighthouse on 127.0.0.1:PORT unless one "
        "answers there, once the job is checked, and pass it as fault_tolerance.lighthouse",
    )
    p.add_argument(
        "--worker-start",
        choices=("auto", "fork", "exec"),
        default="auto",
        help="fork workers from this process (fast; CPU) or exec python -m torchtitan.train (CUDA); "
        "auto: fork unless CUDA is available",
    )
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher options, training arguments), split at the first '--'."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def check_options(opts: argparse.Namespace):
    for name in ("nproc_per_node", "nnodes"):
        if getattr(opts, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(opts, name)}")
    if opts.max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more, got {opts.max_restarts}")
    if opts.rdzv_timeout < 1:
        raise UserError(f"--rdzv-timeout must be a positive number of seconds, got {opts.rdzv_timeout}")
    if opts.node_rank is not None and not 0 <= opts.node_rank < opts.nnodes:
        raise UserError(f"--node-rank {opts.node_rank} is not in 0..{opts.nnodes - 1} (--nnodes {opts.nnodes})")
    if opts.nnodes > 1 and not opts.rdzv_endpoint:
        raise UserError(
            f"--nnodes {opts.nnodes} needs --rdzv-endpoint HOST:PORT (RDZV_ENDPOINT), the address of "
            f"node 0, where the rendezvous store runs; every node passes the same one"
        )
    if opts.rdzv_endpoint and opts.nnodes > 1:
        host, _, port = opts.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise UserError(f"--rdzv-endpoint {opts.rdzv_endpoint!r} is not HOST:PORT")
    if opts.lighthouse_port is not None and not 1 <= opts.lighthouse_port <= 65535:
        raise UserError(
            f"LIGHTHOUSE_PORT (--lighthouse-port) must be a port number, 1..65535, got {opts.lighthouse_port}"
        )
    try:
        ranks = [int(r) for r in opts.log_rank.split(",")]
    except ValueError:
        ranks = [-1]
    if not all(r >= 0 for r in ranks):
        raise UserError(f"--log-rank (LOG_RANK) {opts.log_rank!r} must be a comma list of local ranks, e.g. 0,1")


TORCHRUN_SIGNALS = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"]  # torchrun's default --signals-to-handle


def torchrun_argv(opts: argparse.Namespace, train_argv: list[str], cfg=None) -> list[str]:
    """The torch.distributed.run command line of this launch (exec form: -m torchtitan.train). With the
    job's config: the launcher also passes on the job's stop signals (job.stop_signals, e.g. SIGUSR1,
    which would otherwise kill it) and gives the workers job.stop_grace_seconds to stop before it
    kills them (torchrun's default is 30 s)."""
    endpoint = opts.rdzv_endpoint if opts.nnodes > 1 or opts.rdzv_endpoint else "localhost:0"
    # join_timeout bounds the wait for the other nodes; read_timeout the connection to the store.
    conf = f"join_timeout={opts.rdzv_timeout},read_timeout={min(opts.rdzv_timeout, 60)}"
    if opts.node_rank is not None and opts.nnodes > 1:
        conf += f",is_host={'true' if opts.node_rank == 0 else 'false'}"
    argv = [
        f"--nproc-per-node={opts.nproc_per_node}",
        f"--nnodes={opts.nnodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={opts.rdzv_id}",
        f"--rdzv-conf={conf}",
        f"--max-restarts={opts.max_restarts}",
        f"--local-ranks-filter={opts.log_rank}",
        "--role=rank",
        "--tee=3",
    ]
    if opts.log_dir:
        argv.append(f"--log-dir={opts.log_dir}")
    job = getattr(cfg, "job", None)
    stop_signals = [name for name in getattr(job, "stop_signals", None) or [] if name not in TORCHRUN_SIGNALS]
    argv.append(f"--signals-to-handle={','.join(TORCHRUN_SIGNALS + stop_signals)}")
    grace = getattr(job, "stop_grace_seconds", None)
    if isinstance(grace, (int, float)) and grace > 0:
        argv.append(f"--shutdown-timeout={int(grace) + 15}")
    return argv + ["-m", "torchtitan.train", *train_argv]


def wait_for_store(endpoint: str, timeout: float) -> bool:
    """Whether a TCP connection to `endpoint` succeeds within `timeout` seconds (node 0 may start
    later than this one). Checked here so that an endpoint that never answers ends with one line,
    not with torch's retry log of C++ stack traces."""
    import socket
    import time

    host, _, port = endpoint.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=max(0.1, min(left, 5))).close()
            return True
        except OSError:
            if time.monotonic() + 0.25 >= deadline:
                return False
            time.sleep(0.25)


def worker(*train_argv: str):
    """A forked worker: undo what it inherited from the launcher, then run the trainer."""
    import torch

    # torchrun's handlers (raise in the launcher's agent) would otherwise run here.
    for name in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(","):
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    threads = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(threads) if threads and threads.isdigit() else (_default_threads or 1))
    for stream in (sys.stdout, sys.stderr):  # as `python -u`: lines reach the log as they are written
        try:
            # A TextIOWrapper unless something replaced it (AttributeError).
            cast(io.TextIOWrapper, stream).reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass
    try:  # `ps`/`top` show the rank instead of the launcher's name
        with open("/proc/self/comm", "w") as f:
            f.write(f"titan-rank{os.environ.get('RANK', '?')}"[:15])
    except OSError:
        pass

    from torchtitan import train
    from torchtitan.distributed.process_group import exit_process

    try:
        code = train.main(list(train_argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()  # a bug: the traceback belongs in the worker's log
        code = 1
    if code:
        # Without interpreter finalization, as the exec form does (see distributed.process_group.exit_process).
        exit_process(code)
    # Success returns to torchrun's process wrapper, which reports it and exits without finalization.


def describe_failure(rank: int, failure) -> str:
    code = failure.exitcode
    if code is not None and code < 0:
        try:
            what = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            what = f"was killed by signal {-code}"
    else:
        what = f"exited with status {code}"
    return f"rank {rank} {what}"


def failure_exit_code(failure) -> int:
    code = failure.exitcode or 1
    return code if code > 0 else 128 - code


def log_path(root_log_dir: str, local_rank: int) -> str | None:
    """The stderr log of `local_rank`'s latest attempt (torchrun writes <root>/<run>_*/attempt_N/<rank>/)."""
    import glob

    logs = glob.glob(os.path.join(root_log_dir, "*", "attempt_*", str(local_rank), "stderr.log"))
    return max(logs, key=os.path.getmtime) if logs else None


class _DropWorkerFailureLines:
    """torchrun logs a worker's failure (with a traceback when workers are forked), a signal it received
    and the stopping of each worker; the launcher says it once, in one line, instead."""

    def filter(self, record) -> bool:
        message = str(record.msg)
        return not message.startswith(
            (
                "failed (exitcode",
                "Sending process",
                "Terminating process",
                "Closing process",
                "Received %s death signal",
            )
        )


def _let_finished_workers_exit_on_close():
    """A worker started as a function (fork) that returns hands its result to the agent and then waits
    until the agent has read every worker's result. When the agent stops the workers instead (a stop
    signal: the workers finish their step, save and return), it reads nothing and would wait its
    whole shutdown timeout for workers that are done, then kill them. Releasing that wait first lets
    them exit at once."""
    from torch.distributed.elastic.multiprocessing import api

    close = api.MultiprocessContext._close
    if getattr(close, "_releases_finished_workers", False):
        return

    def _close(self, *args, **kwargs):
        finished = getattr(self, "_worker_finished_event", None)
        if finished is not None:
            finished.set()
        return close(self, *args, **kwargs)

    _close._releases_finished_workers = True  # pyrefly: ignore[missing-attribute]  # a marker on our own function
    api.MultiprocessContext._close = _close


class StopForwarder:
    """The launcher's side of job.stop_signals. torchrun's agent treats each signal it handles as a
    death signal: it stops the workers with it and raises, and the launcher would exit 128 + N even
    when every worker finished its step and saved. For the job's stop signals the launcher instead
    passes the first one on to its workers and keeps watching them: they stop after the same step,
    save, and exit 0, and the launcher exits 0 too (SIGINT, Ctrl-C: 130, what a shell expects of an
    interrupted command, so that `./run_train.sh && next` does not go on). No restart follows a stop.
    A second Ctrl-C kills the workers at once; the checkpoints already published stay."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.received: str | None = None
        self.context = None  # torchrun's process context of the running workers
        self.agent = None

    def install(self):
        """Take the signals over from torchrun each time it starts the workers."""
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
        from torch.distributed.elastic.multiprocessing import api

        forwarder, start, agent_run = self, api.PContext.start, SimpleElasticAgent.run

        def start_then_forward(context, *args, **kwargs):
            start(context, *args, **kwargs)
            forwarder.context = context
            if threading.current_thread() is threading.main_thread():
                for name in forwarder.names:
                    signal.signal(getattr(signal, name), forwarder._handle)

        def run_with_agent(agent, *args, **kwargs):
            forwarder.agent = agent
            return agent_run(agent, *args, **kwargs)

        api.PContext.start = start_then_forward
        SimpleElasticAgent.run = run_with_agent

    def _handle(self, signum, frame):
        from torch.distributed.elastic.multiprocessing.api import SignalException

        name = signal.Signals(signum).name
        if self.received is not None:
            if name == "SIGINT" == self.received:
                raise SignalException("a second SIGINT", signal.SIGKILL)  # the agent kills the workers
            return
        self.received = name
        if self.agent is not None:
            self.agent._remaining_restarts = 0  # a stop is not a failure to recover from
        for pid in self.context.pids().values() if self.context is not None else ():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        again = "; Ctrl-C again ends them at once, without saving" if name == "SIGINT" else ""
        print(f"{name} received: the workers stop after their current step{again}", file=sys.stderr, flush=True)

    def exit_code(self) -> int:
        return 128 + signal.SIGINT if self.received == "SIGINT" else 0


class StoreProbe:
    """On a node other than node 0 (NODE_RANK > 0), wait in the background, while the preflight runs,
    for node 0's rendezvous store to accept connections."""

    def __init__(self, opts: argparse.Namespace):
        import threading

        self.endpoint, self.timeout = opts.rdzv_endpoint, opts.rdzv_timeout
        self.reachable: bool | None = None
        self.thread = None
        if opts.nnodes > 1 and opts.node_rank is not None and opts.node_rank > 0:
            self.thread = threading.Thread(target=self._probe, name="rdzv-probe", daemon=True)
            self.thread.start()

    def _probe(self):
        self.reachable = wait_for_store(self.endpoint, self.timeout)

    def ok(self) -> bool:
        if self.thread is None:
            return True
        self.thread.join()
        if not self.reachable:
            print(
                f"error: nothing answers at the rendezvous endpoint {self.endpoint} after {self.timeout}s "
                f"(RDZV_TIMEOUT): is node 0 running, and is RDZV_ENDPOINT its address and a port it can listen "
                f"on?",
                file=sys.stderr,
                flush=True,
            )
        return bool(self.reachable)


def run(opts: argparse.Namespace, train_argv: list[str], cfg=None) -> int:
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousError,
        RendezvousTimeoutError,
    )
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    for name in (
        "torch.distributed.elastic.multiprocessing.api",
        "torch.multiprocessing.spawn",
        "torch.distributed.elastic.agent.server.api",
    ):
        logging.getLogger(name).addFilter(_DropWorkerFailureLines())
    # torchrun would set this with a banner; one thread per worker unless the environment says otherwise.
    if opts.nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Prefix worker output with the global rank (torchrun's default is the local rank); the workers'
    # log lines then carry no rank of their own (metrics.setup_logging).
    os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}] ")

    config, cmd, cmd_args = config_from_args(parse_args(torchrun_argv(opts, train_argv, cfg)))
    stops = StopForwarder(getattr(getattr(cfg, "job", None), "stop_signals", None) or [])
    stops.install()
    fork = opts.worker_start == "fork"
    if opts.worker_start == "auto":
        import torch

        fork = not torch.cuda.is_available()
    if fork:
        config.start_method = "fork"
        entrypoint, args = worker, list(train_argv)
        _let_finished_workers_exit_on_close()
    else:
        entrypoint, args = cmd, cmd_args
    endpoint = config.rdzv_endpoint
    try:
        elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        first_rank, first = e.get_first_failure()
        if first.exitcode == 2:
            return 2  # a user mistake, already printed by the ranks
        if stops.received and all(
            f.exitcode in (128 + signal.Signals[stops.received], -signal.Signals[stops.received])
            for f in e.failures.values()
        ):
            # The signal reached the workers before their trainer was ready to stop after a step, or a
            # second Ctrl-C ended them.
            print(
                f"stopped: {stops.received} ended the workers before they finished a step (training had not "
                f"begun, or Ctrl-C came twice); the checkpoints already published are complete",
                file=sys.stderr,
                flush=True,
            )
            return 128 + signal.Signals[stops.received]
        # A worker killed by a signal takes its peers down with it (their collectives fail, exit 1),
        # and the one that wrote an error file first can be such a peer: name the killed one.
        killed = [
            (rank, f) for rank, f in sorted(e.failures.items()) if f.exitcode < 0 and f.exitcode != -signal.SIGTERM
        ]
        if killed and first.exitcode > 0:
            first_rank, first = killed[0]
        # Workers the agent stopped because of the first failure end with SIGTERM: not worth naming.
        others = [
            describe_failure(rank, f)
            for rank, f in sorted(e.failures.items())
            if rank != first_rank and f.exitcode != -signal.SIGTERM
        ]
        also = f" (and {', '.join(others)})" if others else ""
        assert config.logs_specs is not None  # config_from_args sets it
        where = log_path(config.logs_specs.root_log_dir, first.local_rank)
        logs = f"; its output: {where}" if where else ""
        print(f"error: training failed: {describe_failure(first_rank, first)}{also}{logs}", file=sys.stderr, flush=True)
        return failure_exit_code(first)
    except SignalException as e:
        if stops.received == "SIGINT" and e.sigval == signal.SIGKILL:
            print(
                "stopped: a second SIGINT (Ctrl-C) killed the workers; the checkpoints already published are complete",
                file=sys.stderr,
                flush=True,
            )
            return 128 + signal.SIGINT
        print(
            f"stopped: the launcher received {signal.Signals(e.sigval).name} and passed it to the workers",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(e.sigval)
    except RendezvousTimeoutError:
        print(
            f"error: rendezvous '{opts.rdzv_id}' at {endpoint}: not all {opts.nnodes} nodes joined within "
            f"{opts.rdzv_timeout}s (RDZV_TIMEOUT); start the same command on every node with the same "
            f"RDZV_ENDPOINT and RDZV_ID",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except RendezvousConnectionError:
        hosting = opts.node_rank == 0 and opts.nnodes > 1
        reason = (
            f"could not host the rendezvous store on {endpoint} (is the port in use?)"
            if hosting
            else f"could not reach the rendezvous store at {endpoint} within {min(opts.rdzv_timeout, 60)}s: "
            f"is node 0 running, and is RDZV_ENDPOINT its address and a port it can listen on?"
        )
        print(f"error: {reason}", file=sys.stderr, flush=True)
        return 1
    except RendezvousError as e:
        print(f"error: rendezvous at {endpoint} failed: {e}", file=sys.stderr, flush=True)
        return 1
    if stops.received:
        print(
            f"stopped: the launcher received {stops.received}, passed it to the workers, and they stopped after "
            f"a step (exit status {stops.exit_code()})",
            file=sys.stderr,
            flush=True,
        )
        return stops.exit_code()
    return 0


def check_job(opts, train_argv: list[str]) -> tuple["StoreProbe", object]:
    """The launcher's options and the job (config, world size, model, data) checked before any worker
    starts; (the rendezvous probe, the resolved config). Raises UserError or HelpRequested."""
    global _default_threads

    check_options(opts)
    probe = StoreProbe(opts)
    from torchtitan.config import load_config

    if opts.lighthouse_port is not None:
        check_lighthouse_port(opts.lighthouse_port, train_argv)
    train_argv = lighthouse_argv(opts, train_argv)
    try:
        load_config(train_argv)  # a mistake in the arguments or the recipe is found before torch is imported
    except HelpRequested as h:
        from torchtitan.models.registry import help_with_families

        raise HelpRequested(help_with_families(h.text) + launcher_help()) from None
    import torch

    # The launcher itself computes nothing; one thread keeps it from creating an OpenMP pool, which
    # forked workers could not use. They restore their own count.
    _default_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    from torchtitan.preflight import check

    # Several nodes share the dump folder: only node 0 (which no worker of this job can precede)
    # checks that no other run holds it; rank 0 takes the lock when the workers start.
    check_lock = opts.nnodes == 1 or opts.node_rank == 0
    # The lighthouse is asked last: LIGHTHOUSE_PORT starts one only for a job that passed every other check.
    cfg = check(train_argv, opts.nproc_per_node * opts.nnodes, check_lock=check_lock, services=False)
    from torchtitan.components import fault_tolerance

    if opts.lighthouse_port is not None:
        started = fault_tolerance.start_local_lighthouse(opts.lighthouse_port)
        if started:
            print(started, file=sys.stderr, flush=True)
    fault_tolerance.check(cfg.fault_tolerance)
    return probe, cfg


def launcher_help() -> str:
    """The launch variables of run_train.sh (NGPU, CONFIG_FILE, LOG_RANK, LIGHTHOUSE_PORT, ...), for --help: its own
    header, where they are documented, when this is a checkout that has it."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "run_train.sh")
    try:
        with open(script) as f:
            header = f.read().split("\nset -euo pipefail", 1)[0].splitlines()
    except OSError:
        return ""
    body = [line[2:] if line.startswith("# ") else line.lstrip("#") for line in header if line.startswith("#")]
    return (
        "\n[run_train.sh: the launch, set as environment variables]\n"
        + "\n".join("  " + line for line in body if not line.startswith("!"))
        + "\n"
    )


def lighthouse_argv(opts, train_argv: list[str]) -> list[str]:
    """The training arguments with LIGHTHOUSE_PORT's lighthouse as fault_tolerance.lighthouse."""
    if opts.lighthouse_port is None:
        return train_argv
    return [*train_argv, "--fault_tolerance.lighthouse", f"http://127.0.0.1:{opts.lighthouse_port}"]


def check_lighthouse_port(port: int, train_argv: list[str]) -> None:
    """LIGHTHOUSE_PORT serves replica groups: refused, before anything starts, for a job that is not one, or that
    names another lighthouse. Judged on the job's own arguments where they load without the lighthouse (a
    fault-tolerant job without one does not: the full check then says what else is wrong)."""
    from torchtitan.config import load_config

    try:
        ft = load_config(train_argv).fault_tolerance
    except (UserError, HelpRequested):
        return
    if not ft.enabled:
        raise UserError(
            f"LIGHTHOUSE_PORT={port} starts a torchft lighthouse for replica groups, but "
            f"fault_tolerance.enabled is false; add --fault_tolerance.enabled (with group_count and "
            f"group_id) or unset LIGHTHOUSE_PORT"
        )
    if ft.lighthouse.rstrip("/") != f"http://127.0.0.1:{port}":
        raise UserError(
            f"LIGHTHOUSE_PORT={port} starts a lighthouse at http://127.0.0.1:{port}, but "
            f"fault_tolerance.lighthouse = {ft.lighthouse}; unset one of them"
        )


def main(argv: list[str]) -> int:
    launcher_argv, train_argv = split_argv(argv)
    opts = parser().parse_args(launcher_argv)
    checked = []
    try:
        code = run_main(lambda: checked.append(check_job(opts, train_argv)))  # a mistake: one line, exit 2
        if not checked:  # a mistake, or --help (printed, exit 0)
            return code
        probe, cfg = checked[0]
        train_argv = lighthouse_argv(opts, train_argv)
        gc.collect()  # the preflight's model and data objects are not worth forking
        # What the launcher imported is the workers' too: kept out of their garbage collections, which would
        # otherwise scan it (~0.2 s per full collection) and copy every page it touches.
        gc.freeze()
        if not probe.ok():
            return 1
    except KeyboardInterrupt:  # in-process callers (the command line has _stopped_early)
        print(STOPPED_EARLY, file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here torchrun and StopForwarder handle it
    return run(opts, train_argv, cfg)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # torchrun's store and agent threads need no finalization
