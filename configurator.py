"""
Command-line overrides for the plain config block at the top of each script (the nanoGPT way):

    python train_ar.py --epochs=4 --attentions=softmax,hedgehog --device=cpu
    python train_ar.py config/ar_h3.py --seeds=0,1,2      # a config file, then overrides on top

Each --key=value must name an existing setting; the value is parsed to that setting's type. A config
file is a Python file of `key = value` lines with literal values (numbers, strings, booleans), read
without running it; its settings are checked the same way and apply in order with the flags.
Unknown keys and values of the wrong type are rejected with a message listing what is valid. --help
lists the settings with their values and the comment on each one's line of the script (print_help).
Floats must be finite. The scripts then check their values before any work, each with a one-line error:
at_least() for sizes and counts, positive() for rates, writable() for where results go, one_of() for
one name from a fixed set, choices() for comma-separated names from one, integers() for
comma-separated integers, sizes() for comma-separated sizes like 1x12x64, layer_list() for layer indices
(no list may repeat a value or have an empty entry; entries() splits a list at its commas, repeated()
checks a list a script builds itself).
pick_device() resolves the scripts' device = "auto" and refuses a device the machine lacks; pyplot()
imports matplotlib only when it is there.
"""
import ast
import math
import os
import sys
import tokenize

import torch


def configure(config, argv=None):
    """Apply config files and --key=value overrides from argv (default sys.argv[1:]) to the dict `config` in place."""
    argv = sys.argv[1:] if argv is None else argv
    for arg in argv:
        if arg in ("-h", "--help"):
            print_help(config)
            sys.exit(0)
        if arg.endswith(".py") and not arg.startswith("--"):
            for key, value in read_config_file(arg):
                set_value(config, key, value, f"{arg}: {key}")
            continue
        if not arg.startswith("--") or "=" not in arg:
            sys.exit(f"error: expected --key=value or a config file, got {arg!r} (--help lists the settings)")
        key, value = arg[2:].split("=", 1)
        set_value(config, key, value, f"--{key}")
    return config


def print_help(config):
    """Each setting, its value and the comment on its line in the running script: a module-level
    `key = value  # note` (the config block) or a dict entry `"key": value,  # note`."""
    notes, main = {}, getattr(sys.modules["__main__"], "__file__", None)
    if main:
        lines = {}  # line number -> its tokens
        with open(main) as f:
            for t in tokenize.generate_tokens(f.readline):
                if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                    lines.setdefault(t.start[0], []).append(t)
        for key, op, *_, comment in (line for line in lines.values() if len(line) >= 3):
            if comment.type == tokenize.COMMENT and ((key.type == tokenize.NAME and key.start[1] == 0 and op.string == "=")
                                                     or (key.type == tokenize.STRING and op.string == ":")):
                notes.setdefault(key.string.strip("\"'"), comment.string.lstrip("# "))
    print("settings (override with --key=value):")
    for key, value in config.items():
        setting, note = f"  --{key}={value}", notes.get(key)
        if note:
            setting += " " * (32 - len(setting)) + f"  {note}" if len(setting) < 32 else f"\n{'':32}  {note}"
        print(setting)


def read_config_file(path):
    """[(key, value), ...] from a file of `key = literal` lines."""
    try:
        tree = ast.parse(open(path).read(), path)
    except (OSError, SyntaxError) as e:
        sys.exit(f"error: cannot read config file {path}: {e}")
    pairs = []
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # a docstring
            continue
        try:
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
                raise ValueError
            pairs.append((node.targets[0].id, ast.literal_eval(node.value)))
        except ValueError:
            sys.exit(f"error: {path}:{node.lineno}: only `key = literal` lines are allowed in a config file")
    return pairs


def set_value(config, key, value, where):
    """config[key] = value, parsed from a string or checked, to the type of the current value."""
    if key not in config:
        sys.exit(f"error: unknown setting {key!r}; valid: {', '.join(config)}")
    old = config[key]
    try:
        if isinstance(old, bool):
            if str(value).lower() not in ("true", "false", "1", "0"):
                raise ValueError
            new = str(value).lower() in ("true", "1")
        elif isinstance(value, str) or (isinstance(old, float) and type(value) is int):
            new = type(old)(value)
        elif type(value) is type(old):
            new = value
        else:
            raise ValueError
        if isinstance(new, float) and not math.isfinite(new):  # nan passes every range check, inf most
            raise ValueError
    except ValueError:
        kind = {bool: "a boolean (true or false)", int: "an integer", float: "a finite float"}.get(type(old), "a string")
        sys.exit(f"error: {where} expects {kind}, got {value!r}")
    config[key] = new


def at_least(cfg, low, *keys):
    """Refuse settings below `low` (sizes and counts), naming the setting and its value."""
    for key in keys:
        if cfg[key] < low:
            sys.exit(f"error: --{key}={cfg[key]} is out of range: it must be at least {low}")


def positive(cfg, *keys):
    """Refuse settings that are not > 0 (learning rates, temperatures)."""
    for key in keys:
        if not cfg[key] > 0:
            sys.exit(f"error: --{key}={cfg[key]} is out of range: it must be greater than 0")


def writable(cfg, *keys, folder=False):
    """Refuse settings that say where results go (a file, or with folder=True a folder) when nothing could be
    written there: empty, a folder where a file is wanted, a path below a file, or a place this user cannot
    write. Checked before the work, not at its end, and without creating anything."""
    for key in keys:
        path = cfg[key]
        if not path:
            sys.exit(f"error: --{key} is empty: it must name where the results go")
        if not folder and os.path.isdir(path):
            sys.exit(f"error: --{key}={path} is a folder: it must name a file")
        if not folder and os.path.exists(path) and not os.access(path, os.W_OK):
            sys.exit(f"error: --{key}={path} cannot be written: the file is read-only")
        parent = os.path.abspath(path if folder else os.path.dirname(path) or ".")
        while not os.path.exists(parent):  # the nearest part of the path that exists decides
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            sys.exit(f"error: --{key}={path} cannot be written: {parent} is a file, not a folder")
        if not os.access(parent, os.W_OK | os.X_OK):
            sys.exit(f"error: --{key}={path} cannot be written: {parent} is not writable")


def one_of(cfg, key, valid):
    """Setting `key`, which must be exactly one of the names `valid`."""
    if cfg[key] not in valid:
        sys.exit(f"error: --{key}={cfg[key]}: give one of {', '.join(valid)}")
    return cfg[key]


def choices(cfg, key, valid):
    """The comma-separated names of setting `key` as a list; an unknown or repeated one is refused."""
    got = entries(cfg, key)
    unknown = [n for n in got if n not in valid]
    if unknown:
        sys.exit(f"error: --{key}: unknown {', '.join(unknown)}; valid: {', '.join(valid)}")
    repeated(key, got)
    return got


def entries(cfg, key):
    """Setting `key` split at its commas; an empty list or entry (a stray comma) is refused, not skipped."""
    got = str(cfg[key]).split(",")
    if "" in got:
        sys.exit(f"error: --{key}={cfg[key]!r} has an empty entry: give comma-separated values, none empty")
    return got


def repeated(key, values):
    """Refuse a list that names something twice (it would run, and be reported, twice)."""
    twice = sorted({str(v) for v in values if values.count(v) > 1})
    if twice:
        sys.exit(f"error: --{key} lists {', '.join(twice)} more than once")


def integers(cfg, key, low=0):
    """The comma-separated integers of setting `key` (seeds, sizes, lengths), each at least `low`."""
    try:
        values = [int(x) for x in entries(cfg, key)]
    except ValueError:
        sys.exit(f"error: --{key}={cfg[key]!r} is not a comma-separated list of integers")
    if min(values) < low:
        sys.exit(f"error: --{key}={cfg[key]!r} must list integers >= {low}")
    repeated(key, values)
    return values


def sizes(cfg, key, n):
    """Setting `key`'s comma-separated sizes of n integers >= 1 joined by x (e.g. 1x12x64), as tuples."""
    got = entries(cfg, key)
    try:
        values = [tuple(int(x) for x in size.split("x")) for size in got]
    except ValueError:
        values = []
    if not values or any(len(v) != n or min(v) < 1 for v in values):
        sys.exit(f"error: --{key}={cfg[key]!r} is not a comma-separated list of sizes like {'x'.join('8' * n)}")
    repeated(key, got)
    return values


def layer_list(cfg, n_layers):
    """Setting "layers": "all" or comma-separated indices of a model with n_layers layers."""
    if cfg["layers"] == "all":
        return list(range(n_layers))
    try:
        ids = [int(i) for i in cfg["layers"].split(",")]
    except ValueError:
        ids = [-1]
    if not ids or min(ids) < 0 or max(ids) >= n_layers:
        sys.exit(f"error: --layers={cfg['layers']}: 'all' or indices of the model's layers 0..{n_layers - 1}")
    repeated("layers", ids)
    return ids


def pick_device(name="auto"):
    """'auto' -> cuda, then mps, then cpu; any other name must be a device this machine has."""
    if name != "auto":
        try:
            dev = torch.device(name)
        except RuntimeError:
            sys.exit(f"error: --device={name} is not a device name; valid: auto, cpu, cuda, cuda:<index>, mps")
        have = {"cpu": 1, "cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0,
                "mps": int(bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()))}
        if (dev.index or 0) >= have.get(dev.type, 0):
            sys.exit(f"error: --device={name}: this machine or PyTorch build has no such device; try --device=auto")
        return name
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def pyplot():
    """matplotlib.pyplot with a file-only backend, or None (and a message) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figures (pip install matplotlib)")
        return None
    return plt
