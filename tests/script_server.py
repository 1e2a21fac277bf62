"""A process that imports torch and the suite's modules once, then forks one child per script run.

Most end-to-end tests run an entry script for a second or two of work, yet a fresh interpreter spends
several seconds importing torch first. tests/helpers.py's run_script hands each run to this server
instead: the server forks, and the child becomes what `python <argv>` would have been (argv, working
directory, environment, standard streams, exit status, `__main__`), without the import. Under torchrun the
launcher runs here too, and its workers (`PYTHON_EXEC`, see script_shim.py) are forked here as well, so a
two-process run starts no new interpreter with torch at all.

What differs from a fresh interpreter, and why it is safe here: the modules of PRELOAD (and
PRELOAD_OPTIONAL) are already imported (their import-time code ran once, under the server's environment:
OMP_NUM_THREADS=1, as every test run has it; none starts a thread), the sorters' numba loops are loaded from numba's disk cache (load_compiled_loops; numba
starts no thread for them, so a fork keeps them usable), the HMDA sample under $CDGRAB_DATA is read
(keep_hmda_loaded: a run reading it gets the copy read here), what was loaded is frozen out of the garbage
collector (freeze_preloaded), and sys.path keeps the checkout.
tests/test_device.py (every entry script's --help), tests/test_scripts_help.py and tests/test_notebooks.py
(analysis imports no torch) still start real interpreters, so an import that fails only in a fresh one is
caught there. CDGRAB_TEST_FORK=0 turns the server off (every run a real subprocess).

Protocol (one SOCK_SEQPACKET connection per run): the requester sends one JSON message
{"argv": [...python's arguments...], "cwd": str, "env": {...}} with its stdin, stdout and stderr as
three file descriptors; the server answers {"pid": int} at the fork and {"returncode": int} at the exit
(-N: killed by signal N, as subprocess reports it). A requester that hangs up takes its run with it
(SIGKILL): that is how a timeout ends a run.
"""
import json
import os
import select
import signal
import socket
import sys
from pathlib import Path

PRELOAD = ("numpy", "pandas", "tqdm", "torch", "torch.distributed.run", "transformers", "sorters", "engine.entry",
           "data.hmda", "data.m4", "data.wikitext2", "data.wikitext103", "models")
# imported too where they import (transformers' GPT-2 and Trainer behind its lazy package: about two seconds
# that each GPT-2 run and Hugging Face example would spend again); where they do not, their tests skip
PRELOAD_OPTIONAL = ("models.gpt2", "sorters.hf")


def serve(path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    for name in PRELOAD_OPTIONAL:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    load_compiled_loops()
    keep_hmda_loaded()
    freeze_preloaded()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(256)
    children = {}  # pid -> the requester's connection
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([sys.stdin, listener, *children.values()], [], [], 0.02)
        for ready in readable:
            if ready is sys.stdin:  # the test process closed our stdin (or died): end every run, then us
                if not os.read(sys.stdin.fileno(), 1):
                    for pid in children:
                        os.kill(pid, signal.SIGKILL)
                    return
            elif ready is listener:
                start(listener, children)
            else:  # a requester hung up before its run ended
                pid = next(pid for pid, conn in children.items() if conn is ready)
                os.kill(pid, signal.SIGKILL)
        reap(children)


def load_compiled_loops() -> None:
    """The sorters' numba loops (CD-GraB's, and KH-SGD's and SBW's), loaded from numba's disk cache once
    here: each run that balances would otherwise spend about a second loading numba's compiler and them."""
    from sorters import build_sorter

    build_sorter("CD-GraB", 1, 2, 1)  # the constructors load the loops (sorters/balance.py, randomized.py)
    build_sorter("KH-SGD", 1, 2, 1, epochs=1)


def freeze_preloaded() -> None:
    """Every object the imports above made goes into the collector's permanent generation (gc.freeze), so
    a fork's garbage collections never walk them: a walk writes to each object's header, and every page it
    writes to is copied into the fork (copy-on-write), much of a small run's CPU time. What a fork allocates
    itself is collected as before; the preloaded modules live as long as the process either way."""
    import gc

    gc.collect()
    gc.freeze()


def keep_hmda_loaded() -> None:
    """LR-HMDA's data set (the HMDA 2018 sample under $CDGRAB_DATA) read once here: each LR-HMDA run and
    example spent about 0.8 s decompressing and parsing it. A read of that file, unchanged (path, size,
    modification time), returns what was read here (a fork's copy); any other file is read as before."""
    import data.hmda as hmda

    read, kept = hmda._load_sample, {}

    def load_sample(path: Path):
        stat = path.stat()
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        if key not in kept:
            kept[key] = read(path)
        return kept[key]

    hmda._load_sample = load_sample  # load_hmda looks it up at each call
    sample = Path(os.environ.get("CDGRAB_DATA", "")) / "hmda" / hmda.SAMPLE_FILES[0]
    if os.environ.get("CDGRAB_DATA") and sample.is_file():
        load_sample(sample)


def start(listener, children: dict) -> None:
    conn, _ = listener.accept()
    message, fds, _, _ = socket.recv_fds(conn, 1 << 22, 3)
    if len(fds) != 3:
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in children.values():
            other.close()
        run_child(json.loads(message), fds, conn)
    for fd in fds:
        os.close(fd)
    conn.send(json.dumps({"pid": pid}).encode())
    children[pid] = conn


def reap(children: dict) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:
                pass
            conn.close()


def run_child(request: dict, fds: list, conn) -> None:
    """Become `python <request argv>`; never returns."""
    import atexit
    import runpy
    import threading

    code = 1
    try:
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = list(request["argv"])
        while argv and argv[0] in ("-u", "-B"):  # torchrun starts its workers with -u
            argv.pop(0)
        if argv[:1] in (["-"], ["-c"]):  # the program on stdin, or in the next argument
            source = sys.stdin.read() if argv[0] == "-" else argv[1]
            sys.argv = ["-", *argv[1:]] if argv[0] == "-" else ["-c", *argv[2:]]
            sys.path[0] = ""
            code = exit_code(lambda: run_source(source, "<stdin>" if argv[0] == "-" else "<string>"))
        elif argv[:1] == ["-m"]:
            module, rest = argv[1], argv[2:]
            sys.modules.pop(module, None)  # preloaded (torch.distributed.run): runpy would warn on stderr
            sys.argv = [module, *rest]
            sys.path[0] = os.getcwd()
            code = exit_code(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))
        else:
            script = os.path.abspath(argv[0])
            sys.argv = [argv[0], *argv[1:]]
            sys.path[0] = os.path.dirname(script)
            code = exit_code(lambda: runpy.run_path(script, run_name="__main__"))
        threading._shutdown()  # as the interpreter does at exit: wait for non-daemon threads
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 -- the child must reach os._exit whatever happened
        sys.excepthook(*sys.exc_info())
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def run_source(source: str, filename: str) -> None:
    """Run program text as the __main__ module, as `python -` and `python -c` do."""
    import types

    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    saved, sys.modules["__main__"] = sys.modules["__main__"], main
    try:
        exec(compile(source, filename, "exec"), main.__dict__)
    finally:
        sys.modules["__main__"] = saved


def exit_code(main) -> int:
    """The exit status of the interpreter that ran main(), with what it prints at exit."""
    try:
        main()
        return 0
    except SystemExit as stop:
        if stop.code is None:
            return 0
        if isinstance(stop.code, int):
            return stop.code
        print(stop.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        return 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001
        sys.excepthook(*sys.exc_info())
        return 1


if __name__ == "__main__":
    serve(sys.argv[1])
