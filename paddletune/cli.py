"""Script entry points: bad input ends in one `error:` line and exit code 2, never a traceback.

    @cli.entry
    def main(argv=None): ...          # may raise; returns the exit code otherwise
    if __name__ == "__main__":
        cli.finish(main())            # sys.exit, in order under paddle.distributed.launch

Whatever main raises on the way (argument checks, loading a checkpoint, reading data, resuming,
saving) is one of:
  the user's to fix   ValueError (ArgumentError, DataError, a bad checkpoint, ...), OSError
                      (missing file, permission, disk full), ArithmeticError (divergence),
                      MemoryError: printed as `error: <message>` on stderr, exit code 2
  a bug               any other exception: `error: unexpected <Type>: <message> ...`, exit 1
PADDLETUNE_DEBUG=1 prints the traceback as well. Locks on output directories (outdir.claim) are
released on every way out.

Under paddle.distributed.launch (several ranks) an error on one rank must end the whole job: the
rank prints its line and leaves at once with os._exit, skipping the interpreter's teardown (which
can wait on the process group). The launcher sees a rank fail and stops the others, including a
rank blocked in a collective that waits for the failed one (SIGTERM, then SIGKILL after 3 s);
a rank stopped that way says so in one line when python gets to run (stopping.py: SIGINT /
SIGTERM, a user's stop, and the launcher's death).
"""
import functools
import os
import sys
import time
import traceback

from . import stopping

USER_ERRORS = (ValueError, OSError, ArithmeticError, MemoryError)


def debug():
    return os.environ.get("PADDLETUNE_DEBUG", "").lower() not in ("", "0", "false", "no")


def _world():
    try:
        return int(os.environ.get("PADDLE_TRAINERS_NUM", "1")), int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    except ValueError:
        return 1, 0


def message(e):
    """The message of exception `e`; an OSError from the system names its file."""
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        two = f" -> {e.filename2}" if e.filename2 else ""
        return f"{e.strerror}: {e.filename}{two}"
    return str(e) or type(e).__name__


def report(e):
    """(exit code, the error line) for exception `e`."""
    world, rank = _world()
    where = f" (rank {rank} of {world})" if world > 1 else ""
    if isinstance(e, USER_ERRORS):
        return 2, f"error: {message(e)}{where}"
    return 1, (f"error: unexpected {type(e).__name__}: {message(e)}{where} (a bug, or an input "
               "nothing checks: please report it; PADDLETUNE_DEBUG=1 shows the traceback)")


LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
             "Socket closed", "Timed out waiting")


def _lost_peer(e):
    """A collective that failed because another rank went away (it failed first)."""
    text = str(e)
    return isinstance(e, (RuntimeError, OSError)) and (
        any(m in text for m in LOST_PEER) or "gloo/transport" in text)   # gloo: reset, TIMEOUT


def _release():
    from . import outdir

    try:
        outdir.release_all()
    except OSError:
        pass


def finish(code):
    """The end of a script run as a program: sys.exit(code), except in a launched rank whose
    process group is up and whose main returned 0, which ends through parallel.engine.finish (a
    world barrier, a handshake that keeps the store servers up until every rank has passed it,
    then os._exit: engine.finish says why an ordinary exit can crash a rank after a successful
    run). Not in main itself: tests call several mains in one launched process."""
    if code in (0, None):
        from .parallel import engine

        if engine.running():
            stopping.install()   # a stop while waiting for the others still says which rank failed
            engine.finish(0)     # does not return
    sys.exit(code)


def entry(main):
    """Wrap a script's main(argv=None) as described in the module docstring."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        world, _ = _world()
        handlers = stopping.install()   # SIGINT / SIGTERM, the launcher's death (stopping.py)
        try:
            return main(*args, **kwargs)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:   # noqa: B902 - every failure ends in one line
            if debug():
                traceback.print_exc()
            code, line = report(e)
            if world > 1 and not _lost_peer(e):   # the others' SIGTERM says "another rank failed"
                stopping.mark_failed(_world()[1], code)   # and exits with this code
            if world > 1 and _lost_peer(e):
                # another rank failed first and its error is the one to show: the launcher names
                # the first failed rank it sees, so give it time to see that one and stop this
                # one (SIGTERM: _on_sigterm); leave by ourselves only if that does not come
                _release()
                time.sleep(5)
                line = (f"error: rank {_world()[1]} of {world} lost the connection to another rank "
                        "of this job, which failed or was stopped first (its error is in its log)")
                code = 2
            print(line, file=sys.stderr, flush=True)
            if world > 1:   # the peers may wait in a collective for this rank: end it now
                sys.stdout.flush()
                _release()
                os._exit(code)
            return code
        finally:
            _release()
            stopping.restore(handlers)
    return run
