"""What a run reports and profiles, from its arguments (pure python: args.py checks these before
any work; trainer/reporting.py and trainer/profiling.py act on them).

    report_targets(["visualdl,tensorboard"])      -> ["visualdl", "tensorboard"]
    missing_library("tensorboard")                -> None, or the pip command that installs it
    profile_plan(training_args)                   -> None, or ProfilePlan(start, end, path, traces)

report_to (PaddleNLP's / Hugging Face's key): names of integrations, as one string, a comma list
or a list. "all" is every integration whose library is installed; "none" (or unset) is none.
Unset is PaddleNLP's "visualdl"; here the libraries are optional extras, so unset writes none.

Profiling keys (any of them turns the per-step phase timer on):
  skip_profile_timer: false            PaddleNLP's timers: the phase breakdown only, no traces
  profiler: true                       paddle.profiler traces over profiler_steps (START,END)
  profiler_options: "k=v;k=v"          PaddleNLP's profiler string: batch_range=[START,END],
                                       profile_path=DIR, timer_only=true|false (other PaddleNLP
                                       options - state, sorted_key, tracer_option, record_shapes,
                                       exit_on_finished - are accepted and not used)
The window counts this run's optimizer steps from 0 (paddle.profiler's scheduler): [2,4] traces
the 3rd and 4th step, which train_log.jsonl numbers 3 and 4 on a fresh run.
"""
import importlib
import os
from typing import NamedTuple, Optional

INTEGRATIONS = {"visualdl": ("visualdl", "pip install visualdl   (or: pip install -e '.[visualdl]')"),
                "tensorboard": ("tensorboard", "pip install tensorboard   (or: pip install -e '.[tensorboard]')")}
PNG_LIBRARY = ("matplotlib", "pip install matplotlib   (or: pip install -e '.[plot]')")
PADDLENLP_PROFILER_KEYS = ("batch_range", "profile_path", "timer_only", "state", "sorted_key",
                           "tracer_option", "record_shapes", "exit_on_finished")
DEFAULT_WINDOW = (10, 20)   # PaddleNLP's batch_range default


class ProfilePlan(NamedTuple):
    start: Optional[int]    # first traced step (counted from 0); None: no traces
    end: Optional[int]      # one past the last traced step
    path: Optional[str]     # where the chrome traces go
    traces: bool


def missing_library(module):
    """None when `module` imports, else why not (the import's message)."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        return str(e) or f"no module named {module}"
    return None


def report_targets(report_to):
    """The integrations named by report_to (None, a string or a list of strings), in order,
    without repeats. Raises ValueError naming an unknown one; "all" keeps the installed ones."""
    names = []
    for item in [report_to] if isinstance(report_to, str) else report_to or []:
        names += [n.strip().lower() for n in str(item).split(",") if n.strip()]
    out = []
    for n in names:
        if n == "none":
            continue
        if n == "all":
            out += [k for k, (mod, _) in INTEGRATIONS.items() if missing_library(mod) is None]
        elif n in INTEGRATIONS:
            out.append(n)
        else:
            raise ValueError(f"names {n!r}, which is not an integration here: use visualdl, "
                             "tensorboard, all (those installed) or none")
    return list(dict.fromkeys(out))


def check_libraries(targets):
    """ValueError with the pip command for the first integration whose library does not import."""
    for name in targets:
        module, pip = INTEGRATIONS[name]
        why = missing_library(module)
        if why is not None:
            raise ValueError(f"{name} needs the {module} package, which does not import here "
                             f"({why}): {pip}; or drop it from report_to")


def parse_window(text):
    """'START,END' or '[START,END]' -> (START, END) with 0 <= START < END. The ValueError's
    message has no subject (args.py puts the key before it)."""
    parts = str(text).strip().strip("[]").split(",")
    try:
        start, end = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"must be START,END (two integers, e.g. 2,4), got {text!r}") from None
    if not 0 <= start < end:
        raise ValueError(f"must have 0 <= START < END (steps START..END-1 are traced), got {text!r}")
    return start, end


def parse_profiler_options(text):
    """PaddleNLP's 'key=value;key=value' profiler string -> {key: value} (batch_range a pair,
    timer_only a bool). ValueError naming the bad part."""
    out = {}
    for part in str(text).replace(" ", "").split(";"):
        if not part:
            continue
        key, eq, value = part.partition("=")
        if not eq or key not in PADDLENLP_PROFILER_KEYS:
            raise ValueError(f"has {part!r}; expected key=value pairs separated by ';' "
                             f"with keys {', '.join(PADDLENLP_PROFILER_KEYS)} "
                             "(e.g. 'batch_range=[10,20];profile_path=./profiler_log')")
        if key == "batch_range":
            try:
                value = parse_window(value)
            except ValueError as e:
                raise ValueError(f"batch_range {e}") from None
        elif key in ("timer_only", "record_shapes", "exit_on_finished"):
            value = value.lower() in ("1", "true", "yes", "t")
        out[key] = value
    return out


def profile_plan(args):
    """None when no profiling key is on; else the ProfilePlan (traces need profiler or
    profiler_options without timer_only=true). ValueError on a malformed value."""
    options = parse_profiler_options(args.profiler_options) if args.profiler_options else None
    if options is None and not args.profiler and args.skip_profile_timer:
        return None
    default_path = os.path.join(args.output_dir or ".", "profiler")
    if options is not None:
        start, end = options.get("batch_range", DEFAULT_WINDOW)
        traces = not options.get("timer_only", False)
        return ProfilePlan(start, end, options.get("profile_path", default_path), traces)
    if args.profiler:
        start, end = parse_window(args.profiler_steps)
        return ProfilePlan(start, end, default_path, True)
    return ProfilePlan(None, None, None, False)
