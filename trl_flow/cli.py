"""The ``trl-flow`` command line: one subcommand per trainer, and ``reward-server``.

    trl-flow grpo --config sd35m_flow_grpo_pickscore              # a recipe shipped in trl_flow/recipes
    trl-flow op-grpo --config my_recipe.yaml --learning_rate 1e-4  # the command line overrides the recipe
    trl-flow grpo --accelerate_config multi_gpu --num_processes 8 --config sd35m_flow_grpo_geneval
    trl-flow reward-server --help

Arguments are parsed by ``trl.TrlParser`` from :class:`ScriptArguments` and the trainer's config dataclass, so
every config field is a flag, ``--config <yaml>`` sets their values (keys are exactly field names), and options
must be spelled out in full (``--num_gen`` is an error, not ``--num_generations``). ``--accelerate_config NAME``
(a config shipped in ``trl_flow/accelerate_configs`` or a file) re-runs the command under ``accelerate launch
--config_file <file>``, like TRL's CLI; the remaining ``accelerate launch`` options (``--num_processes``,
``--machine_rank``, ``--main_process_ip``, ...) are passed on to it. Without it the run happens in this process,
which is also what ``accelerate launch -m trl_flow.cli grpo ...`` does on every process.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys
from dataclasses import dataclass, field

DEFAULT_MODEL = "stabilityai/stable-diffusion-3.5-medium"

REWARD_SERVER = "reward-server"
PRECOMPUTE = "precompute-embeds"
_CHILD_ENV = "TRL_FLOW_UNDER_ACCELERATE_LAUNCH"  # set for the processes that --accelerate_config starts


class CLIError(ValueError):
    """Bad command-line input; ``main`` prints it and exits with status 2."""


class _Parser:
    """Mixin for the command's parser: argparse's own errors (a bad value, a missing one) become a
    :class:`CLIError` (one line, no usage block) instead of printing and exiting."""

    def error(self, message):
        raise CLIError(message)

    def set_defaults_with_config(self, **config):
        """A recipe's value for a list field may be one value (``reward_funcs: shapes_partial``, ``reward_weights:
        2.0``): it is a one-item list, never iterated letter by letter; every item gets the field's type, as on the
        command line."""
        config = _recipe_trl_names(getattr(self, "config_cls", None), config, getattr(self, "recipe", ""))
        actions = {a.dest: a for a in self._actions}
        for key, value in config.items():
            action = actions.get(key)
            if action is None or action.nargs not in ("+", "*") or value is None:
                continue
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            for item in items:
                if isinstance(item, (list, dict)):
                    raise CLIError(f"--config {getattr(self, 'recipe', '')}: {key}: expected a value or a list of "
                                   f"values, got {item!r:.60}")
            try:
                config[key] = [self._get_value(action, str(item)) for item in items]
            except argparse.ArgumentError as e:
                raise CLIError(f"--config {getattr(self, 'recipe', '')}: {key}: {e.message}") from None
        return super().set_defaults_with_config(**config)


@dataclass
class ScriptArguments:
    """What the command needs besides the trainer config: model, prompts, rewards, launch. Names follow TRL's
    ``ScriptArguments`` / ``ModelConfig`` (``dataset_name``, ``dataset_train_split``, ``model_name_or_path``, ...)."""

    model_name_or_path: str = field(default=DEFAULT_MODEL, metadata={"help": "Hub id or folder of a diffusers "
        "pipeline trl_flow supports (SD3/3.5, ...), or `shapes` for the committed tiny shapes base model."})
    dtype: str = field(default="auto", metadata={"help": "dtype the pipeline is loaded in: auto (bfloat16 with "
        "--bf16, float16 with --fp16, else float32), float32, bfloat16 or float16."})
    dataset_name: str | None = field(default=None, metadata={"help": "Training prompts: a .txt (one prompt per line), "
        "a .jsonl with a `prompt` key, a Hub dataset or a local dataset folder, or `shapes` (the shapes task)."})
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration name of a Hub dataset (the "
        "`name` argument of `datasets.load_dataset`)."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split of `dataset_name` to train on."})
    dataset_test_split: str = field(default="test", metadata={"help": "Split used for evaluation: of `eval_dataset` "
        "if given, else of `dataset_name` (when `eval_steps` > 0)."})
    eval_dataset: str | None = field(default=None, metadata={"help": "Evaluation prompts, in any format of "
        "`dataset_name`; its `dataset_test_split` split is loaded."})
    reward_funcs: list[str] | None = field(default=None, metadata={"help": "Rewards: names exported by "
        "`trl_flow.rewards` (e.g. jpeg_incompressibility), shapes_partial / shapes_strict, `module:callable` (a class "
        "is instantiated without arguments), or the http(s) URL of a `trl-flow reward-server`, with its client "
        "options in the query string: `http://host:8001?timeout=30&max_retries=5&backoff=2&batch_size=8&name=geneval` "
        "(seconds per request, default 120; further attempts, 3; seconds before the first retry, doubled each time, "
        "1; images per request, 16; logged name, remote)."})
    accelerate_config: str | None = field(default=None, metadata={"help": "Run under `accelerate launch` with this "
        "config: a name shipped in trl_flow/accelerate_configs (single_gpu, multi_gpu, multi_node, fsdp2, zero2, "
        "zero3) or a file. Other `accelerate launch` options are passed on."})
    trainer: str | None = field(default=None, metadata={"help": "The subcommand a recipe is written for (grpo, "
        "op-grpo, stepwise, dppo, nft); running a recipe with another subcommand is an error."})
    num_threads: int | None = field(default=None, metadata={"help": "torch CPU threads per process "
        "(torch.set_num_threads). Default: OMP_NUM_THREADS if set, else 1; 0 = torch's own default (one per core), "
        "which is faster only on an idle machine with large CPU ops: with other processes busy, spinning threads made "
        "a 2-iteration shapes run 3-7x slower."})

    def __post_init__(self):
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r}: must be auto, float32, bfloat16 or float16")
        if self.trainer is not None and self.trainer not in commands():
            raise ValueError(f"trainer={self.trainer!r}: must be one of {', '.join(commands())} (the registered "
                             "trainers, trl_flow.registered_trainers())")
        if self.num_threads is not None and self.num_threads < 0:
            raise ValueError(f"num_threads={self.num_threads}: must be >= 0 (0 = torch's default, one per core)")


def resolve_num_threads(num_threads: int | None, environ=os.environ) -> int | None:
    """The torch thread count a run uses: ``num_threads`` if given (0 = leave torch's default, returned as None),
    else ``OMP_NUM_THREADS`` when it is set to a positive integer, else 1.

    Why 1: the intra-op threads of torch's CPU kernels spin while they wait for each other; on a machine whose
    cores are busy with other processes (other runs, the tests, an accelerate launch of several processes) they
    wait for cores and a run collapses (measured, docs/cli.md: 2 threads took 3-7x the wall time of 1 thread and
    4-5x its CPU time on 2 loaded cores). The small models this runs on CPU gain nothing from more threads; a GPU
    run does its work on the GPU."""
    if num_threads is not None:
        return num_threads or None
    env = environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return 1


# ----------------------------------------------------------------------------------------------- lookups
def _package_dir(name: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), name)


def shipped(kind: str) -> dict[str, str]:
    """Name -> path of the YAML files shipped in ``trl_flow/<kind>`` (``recipes`` or ``accelerate_configs``)."""
    folder = _package_dir(kind)
    return {f[: -len(".yaml")]: os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".yaml")}


def _resolve_yaml(value: str, kind: str, flag: str) -> str:
    if os.path.isfile(value):
        return value
    found = shipped(kind)
    name = value[: -len(".yaml")] if value.endswith(".yaml") else value
    if name in found:
        return found[name]
    close = difflib.get_close_matches(name, list(found), n=1, cutoff=0.6)
    hint = f"; did you mean {flag} {close[0]}?" if close else ""
    raise CLIError(f"{flag} {value}: not a file and not a name shipped in trl_flow/{kind} ({', '.join(found)}){hint}")


def commands() -> list[str]:
    """The trainer subcommands: every registered trainer's name (``trl_flow.register_trainer``), then the aliases."""
    from .trainers.registry import registered_trainers, trainer_aliases

    return [*registered_trainers(), *trainer_aliases()]


def canonical(command: str) -> str:
    """The registered name of a subcommand given by name or alias."""
    from .trainers.registry import trainer_aliases

    return trainer_aliases().get(command, command)


def trainer_classes(command: str):
    """The (config class, trainer class) of a subcommand: the registered trainer and its ``config_class``."""
    from .trainers.registry import get_trainer

    try:
        trainer_cls = get_trainer(command)
    except KeyError:
        raise CLIError(f"unknown command {command!r}; commands: {', '.join([*commands(), REWARD_SERVER])}") from None
    return trainer_cls.config_class, trainer_cls


def make_parser(command: str):
    """The ``TrlParser`` of a trainer subcommand (abbreviations rejected)."""
    from trl import TrlParser

    config_cls, _ = trainer_classes(command)
    parser_cls = type("TrlFlowParser", (_Parser, TrlParser), {})
    recipes = [n for n, path in shipped("recipes").items() if _recipe_trainer(path) in (None, canonical(command))]
    parser = parser_cls((ScriptArguments, config_cls), prog=f"trl-flow {command}", allow_abbrev=False,
                        epilog=f"recipes for `trl-flow {command}` (--config NAME): {', '.join(recipes)}")
    parser.config_cls = config_cls  # TRL's names in a recipe (epsilon, num_iterations): _recipe_trl_names
    for action in parser._actions:  # argparse %-formats help texts: a literal "25%" in a field's help broke --help
        if action.help:
            action.help = re.sub(r"%(?!\()", "%%", action.help)
    # TrlParser consumes --config itself; declared here (never stored) so that --help shows it.
    parser.add_argument("--config", default=argparse.SUPPRESS, metavar="RECIPE_OR_YAML",
                        help="A YAML file of field values, or the name of a recipe shipped in trl_flow/recipes "
                             f"({', '.join(recipes)}); flags given after it override it.")
    _short_help(parser, config_cls, command)
    return parser


#: Longest help text `--help` shows for a field; the whole text is in the docs' configuration tables.
HELP_CHARS = 90


def _short(text: str) -> str:
    """A help text's first sentence (ended by ``.`` or ``;`` outside parentheses), at most :data:`HELP_CHARS`
    characters; a parenthesis left open by the cut is closed with ``...)``."""
    text = " ".join(text.split())
    depth, end = 0, len(text)
    for i, c in enumerate(text):
        depth += (c == "(") - (c == ")")
        if depth == 0 and c in ".;" and (i + 1 == len(text) or text[i + 1] == " ") \
                and not text[max(0, i - 3): i + 1].endswith(("e.g.", "i.e.", "vs.")):
            end = i + (c == ".")
            break
    first = text[:end]
    if len(first) > HELP_CHARS:
        first = first[:HELP_CHARS].rsplit(" ", 1)[0] + " ..."
    close = ")" if first.endswith(" ...") else " ...)"
    return first + close * max(0, first.count("(") - first.count(")"))


def _field_groups(config_cls) -> dict[str, str]:
    """Field -> the section it is declared under (the ``# ---- <title> ----`` comments of the config classes;
    a subclass's new fields: ``<method> options``)."""
    import dataclasses
    import inspect

    names = {f.name for f in dataclasses.fields(config_cls)}
    groups = {}
    for klass in reversed(config_cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        title = f"{klass.__name__} options"
        for line in source.splitlines():
            m = re.match(r"\s*# -+ (.+?) -+$", line)
            if m:
                title = m.group(1)
                continue
            m = re.match(r"    (\w+):", line)
            if m and m.group(1) in names and m.group(1) not in groups:
                groups[m.group(1)] = title
    return groups


def _short_help(parser, config_cls, command: str) -> None:
    """``--help`` fits a screen or two: fields grouped by section, each help text cut to its first sentence, a
    short usage line; the long story of each field is in the docs (the configuration table of the method's page)."""
    import dataclasses

    groups = {f.name: "model, data, rewards, launch" for f in dataclasses.fields(ScriptArguments)}
    groups.update(_field_groups(config_cls))
    made = {}
    for action in list(parser._actions):
        title = groups.get(action.dest)
        if title is None:
            continue
        if action.help:
            action.help = _short(action.help)
        # one spelling shown (--max_steps; --max-steps is still accepted), and the value's type as its metavar
        action.option_strings = [o for o in action.option_strings if "-" not in o[2:]] or action.option_strings
        if action.nargs != 0 and action.metavar is None:
            action.metavar = getattr(action.type, "__name__", "value").upper().replace("STRING_TO_BOOL", "BOOL")
        if title not in made:
            made[title] = parser.add_argument_group(title)
        for container in parser._action_groups:
            if action in container._group_actions:
                container._group_actions.remove(action)
        made[title]._group_actions.append(action)
    parser.usage = (f"trl-flow {command} [--config RECIPE_OR_YAML] [--FIELD VALUE ...] "
                    "[--accelerate_config NAME [accelerate launch options]]")
    parser.epilog = ((parser.epilog or "") + ". Each field's full description: the configuration table of its "
                     "method's page in docs/ (e.g. docs/flow_grpo.md), and docs/cli.md.")


def _recipe_trainer(path: str) -> str | None:
    """The ``trainer:`` a shipped recipe names (None if it names none)."""
    with open(path, encoding="utf-8") as f:
        m = re.search(r"^trainer:\s*([\w-]+)", f.read(), flags=re.M)
    return m.group(1) if m else None


def _other_trainer(command: str, recipe: str, written_for: str) -> str:
    """Why a recipe written for another trainer is refused, and the two ways to run it."""
    same = [n for n, p in shipped("recipes").items() if canonical(_recipe_trainer(p) or "") == canonical(command)]
    return (f"--config {recipe}: this recipe is for `trl-flow {written_for}` (its key `trainer: {written_for}`), not "
            f"`trl-flow {command}`. Run it with `trl-flow {written_for} --config {recipe}`; or, to train it with "
            f"{command}, copy it, set `trainer: {command}` and keep only fields of {command}'s config"
            + (f" (recipes for {command}: {', '.join(same)})" if same else ""))


def _did_you_mean(options, flags) -> str:
    """``"; --max_step: did you mean --max_steps?"`` for the misspelled ones among ``options`` (difflib over the
    known ``flags``), or ``""``."""
    hints = []
    for option in options:
        name = option.split("=")[0]
        close = difflib.get_close_matches(name, flags, n=1, cutoff=0.6) if name.startswith("--") else []
        if close:
            hints.append(f"{name}: did you mean {close[0]}?")
    return "".join("; " + h for h in hints)


# ----------------------------------------------------------------------------------------------- parsing
def trl_names(command: str, argv: list[str], say=None) -> list[str]:
    """``argv`` with TRL's GRPOConfig names of our fields (``--epsilon``, ``--num_iterations``:
    :data:`trl_flow.trainers.trl_compat.CONFIG_ALIASES`) replaced by ours, saying so in one line each (``say``,
    default: print to stderr); a TRL name without an equivalent is a :class:`CLIError` naming our field."""
    from .trainers import trl_compat

    config_cls, _ = trainer_classes(command)
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    out = []
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            name, eq, value = token[2:].partition("=")
            try:
                target = trl_compat.alias_target(config_cls, name)
            except ValueError as e:
                raise CLIError(re.sub(r"`(\w+)`", r"--\1", str(e))) from None
            if target is not None:
                say(f"trl-flow {command}: --{name} is TRL's name for --{target}; using --{target}")
                token = f"--{target}{eq}{value}"
        out.append(token)
    return out


def _recipe_trl_names(config_cls, config: dict, recipe: str) -> dict:
    """A recipe's keys with TRL's names of our fields replaced by ours (see :func:`trl_names`)."""
    if config_cls is None:
        return config
    from .trainers import trl_compat

    out = {}
    for key, value in config.items():
        try:
            target = trl_compat.alias_target(config_cls, key)
        except ValueError as e:
            raise CLIError(f"--config {recipe}: {e}") from None
        if target is not None and target in config:
            raise CLIError(f"--config {recipe}: {key} (TRL's name for {target}) and {target} both given; "
                           f"keep {target}")
        out[target or key] = value
    return out


def parse_args(command: str, argv: list[str]):
    """Parse a trainer subcommand's arguments: ``(script_args, config, launch_args)``.

    ``--config`` takes a YAML file or the name of a shipped recipe; its keys must be fields. ``launch_args`` are
    the leftover options, allowed only with ``--accelerate_config`` and only if ``accelerate launch`` knows them.
    """
    argv = trl_names(command, list(argv))
    parser = make_parser(command)
    argv = attach_negative_numbers(parser, list(argv))
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise CLIError("--config: expected a YAML file or a recipe name after it")
        given = argv[i + 1]
        argv[i + 1] = parser.recipe = _resolve_yaml(argv[i + 1], "recipes", "--config")
        _check_recipe(parser.recipe)
        written_for = _recipe_trainer(parser.recipe)  # before its keys are checked against this command's fields
        if written_for is not None and written_for in commands() and canonical(written_for) != canonical(command):
            raise CLIError(_other_trainer(command, given, written_for))
    try:
        script_args, config, config_rest, cli_rest = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True)
    except ValueError as e:  # a field's own check in __post_init__ (names the field)
        raise CLIError(str(e)) from e
    if config_rest:
        keys = [s[2:] for s in config_rest if s.startswith("--")]
        flags = [f[2:] for f in parser._option_string_actions if f.startswith("--")]
        hints = [f"{k} -> {c[0]}" for k in keys if (c := difflib.get_close_matches(k, flags, n=1, cutoff=0.6))]
        raise CLIError(f"--config: unknown keys {keys}; recipe keys must be fields of {type(config).__name__} "
                       "or script arguments (see trl-flow " + command + " --help)"
                       + (f"; did you mean: {', '.join(hints)}?" if hints else ""))
    if script_args.trainer is not None and canonical(script_args.trainer) != canonical(command):
        raise CLIError(_other_trainer(command, getattr(parser, "recipe", "the recipe"), script_args.trainer))
    flags = [f for f in parser._option_string_actions if f.startswith("--") and f != "--help"]
    if cli_rest and not (script_args.accelerate_config and not os.environ.get(_CHILD_ENV)):
        raise CLIError(f"unrecognized arguments: {' '.join(cli_rest)}{_did_you_mean(cli_rest, flags)} (options are "
                       "spelled out in full; `accelerate launch` options need --accelerate_config NAME)")
    if cli_rest:
        from accelerate.commands.launch import launch_command_parser

        known = set(launch_command_parser()._option_string_actions)
        bad = [s for s in cli_rest if s.startswith("-") and s.split("=")[0] not in known]
        if bad:
            raise CLIError(f"unrecognized arguments: {' '.join(bad)}{_did_you_mean(bad, flags)} (neither a field of "
                           f"{type(config).__name__}, a script argument nor an `accelerate launch` option)")
    return script_args, config, cli_rest


_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|-inf|-nan", re.IGNORECASE)


def attach_negative_numbers(parser, argv: list[str]) -> list[str]:
    """``--learning_rate -1e-4`` as ``--learning_rate=-1e-4``: argparse takes a value like ``-1e-4`` (an exponent)
    for an option and says "expected one argument". Only for flags taking one value."""
    actions = parser._option_string_actions
    out = []
    for i, arg in enumerate(argv):
        prev = out[-1] if out else None
        if (prev and prev.startswith("--") and "=" not in prev and prev in actions and actions[prev].nargs is None
                and _NUMBER.fullmatch(arg) and (i < 2 or argv[i - 2] != "--")):
            out[-1] = f"{prev}={arg}"
        else:
            out.append(arg)
    return out


def _check_recipe(path: str) -> None:
    """A recipe must be UTF-8 YAML holding a mapping; else a one-line error naming the file, line and column."""
    import yaml

    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise CLIError(f"--config {path}: line {line} is not UTF-8; save the file as UTF-8") from None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark, context = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        if context is not None and getattr(e, "context", None):
            what += f" ({e.context} at line {context.line + 1}, column {context.column + 1})"
        raise CLIError(f"--config {path}: YAML syntax error{where}: {what}; write one `field: value` per line, "
                       "lists as [a, b]") from None
    if not isinstance(config, dict):
        raise CLIError(f"--config {path}: expected a YAML mapping of `field: value` lines, got "
                       f"{type(config).__name__}")
    _refuse_duplicate_keys(path, text)


def _refuse_duplicate_keys(path: str, text: str) -> None:
    """YAML keeps the last of two equal keys silently: a recipe that sets a field twice is an error naming both
    lines."""
    import yaml

    todo = [yaml.compose(text, Loader=yaml.SafeLoader)]
    while todo:
        node = todo.pop()
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    if key.value in seen:
                        raise CLIError(f"--config {path}: line {key.start_mark.line + 1}: `{key.value}` is set again "
                                       f"(first at line {seen[key.value]}); YAML would silently use the last value: "
                                       "keep one")
                    seen[key.value] = key.start_mark.line + 1
                todo.append(value)
        elif isinstance(node, yaml.SequenceNode):
            todo.extend(node.value)


# ---------------------------------------------------------------------------------------------- building
def resolve_reward(spec: str):
    """A reward callable from its command-line spelling (see ``ScriptArguments.reward_funcs``): a reward-server URL,
    else :func:`trl_flow.rewards.get_reward` (a registered name such as ``pickscore`` or ``shapes_partial``, or
    ``module:callable``; a module next to the recipe is importable, like TRL's scripts)."""
    from trl_flow.rewards import RemoteReward, get_reward

    if spec.startswith(("http://", "https://")):  # options in the query string: ?timeout=30&max_retries=5&backoff=2
        try:
            return RemoteReward.from_url(spec)
        except ValueError as e:
            raise CLIError(f"--reward_funcs: {e}") from e
    if ":" in spec and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = get_reward(spec)
    except (ValueError, TypeError, ImportError) as e:
        raise CLIError(f"--reward_funcs {spec!r}: {e}") from e
    if isinstance(obj, type):
        obj = obj()
    if not callable(obj):
        raise CLIError(f"--reward_funcs {spec}: {obj!r} is not callable")
    return obj


def _load_datasets(script_args: ScriptArguments, config):
    from .data import load_prompts

    if not script_args.dataset_name:
        raise CLIError("dataset_name: required; a .txt or .jsonl of prompts, a Hub dataset id, a dataset folder, "
                       "or `shapes`")
    train = load_prompts(script_args.dataset_name, script_args.dataset_train_split, script_args.dataset_config)
    if script_args.eval_dataset:
        evald = load_prompts(script_args.eval_dataset, script_args.dataset_test_split)
    elif config.eval_steps:
        if script_args.dataset_name.endswith((".txt", ".jsonl")):
            raise CLIError(f"eval_steps={config.eval_steps}: {script_args.dataset_name} has no test split; pass "
                           "--eval_dataset or set --eval_steps 0")
        evald = load_prompts(script_args.dataset_name, script_args.dataset_test_split, script_args.dataset_config)
    else:
        evald = None
    return train, evald


def _load_pipeline(script_args: ScriptArguments, config):
    if script_args.model_name_or_path == "shapes" and not os.path.exists("shapes"):
        from .tasks import shapes

        return shapes.load_base_pipeline()
    from .models import load_pipeline

    dtype = script_args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if config.bf16 else "float16" if config.fp16 else "float32"
    if config.model_init_kwargs:  # the trainer loads the model with them (trl_flow.models.loading), --dtype included
        config.model_init_kwargs.setdefault("dtype", dtype)
        return script_args.model_name_or_path
    return load_pipeline(script_args.model_name_or_path, dtype)


#: torch's elastic launcher (under `accelerate launch` and torchrun) answers a signal by sending it to the processes
#: and SIGKILLs those still running this many seconds later (torch's default: 30), even while they finish their
#: iteration to save it. `trl-flow --accelerate_config` sets it to DEFAULT_SHUTDOWN_TIMEOUT unless it is set already.
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
DEFAULT_SHUTDOWN_TIMEOUT = 1800


def shutdown_timeout_env() -> dict[str, str]:
    """What `trl-flow --accelerate_config` adds to the launcher's environment so that a SIGINT / SIGTERM leaves the
    processes time to finish the iteration and save: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (read by torch's
    ``LaunchConfig`` when torchrun's ``--shutdown_timeout`` is not given), unless the user set it."""
    if os.environ.get(SHUTDOWN_TIMEOUT_ENV):
        return {}
    from torch.distributed.launcher.api import LaunchConfig

    if "shutdown_timeout" not in getattr(LaunchConfig, "__dataclass_fields__", {}):
        import warnings

        warnings.warn("this torch's launcher has no shutdown timeout setting: it SIGKILLs the processes 30 s after a "
                      "SIGINT / SIGTERM, so an iteration that takes longer to finish and save is lost when the run is "
                      "stopped; a newer torch (torchrun --shutdown_timeout) lets them finish", stacklevel=2)
        return {}
    return {SHUTDOWN_TIMEOUT_ENV: str(DEFAULT_SHUTDOWN_TIMEOUT)}


def _launch(command: str, argv: list[str], script_args: ScriptArguments, launch_args: list[str]) -> None:
    """Re-run ``trl-flow <command> <argv>`` under ``accelerate launch --config_file <file> <launch_args>``."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from accelerate.utils import patch_environment

    config_file = _resolve_yaml(script_args.accelerate_config, "accelerate_configs", "--accelerate_config")
    child = list(argv)
    if "--accelerate_config" in child:
        i = child.index("--accelerate_config")
        del child[i : i + 2]
    # Launch options go to accelerate, not to the processes it starts: `launch_args` is an ordered subsequence of
    # `argv` (argparse keeps the order of what it did not recognise); take it out in order.
    pending = iter(launch_args)
    current = next(pending, None)
    kept = []
    for token in child:
        if current is not None and token == current:
            current = next(pending, None)
        else:
            kept.append(token)
    args = launch_command_parser().parse_args(
        ["--config_file", config_file, *launch_args, "--module", "trl_flow.cli", command, *kept])
    import shutil
    import tempfile

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    errors = tempfile.mkdtemp(prefix="trl_flow_errors_")
    # the started processes run the command, not another launch, and leave their error lines for this one to print
    env = {_CHILD_ENV: "1", _ERRORS_ENV: errors}
    env.update(shutdown_timeout_env())
    env.update(cpu_env(command))
    import logging

    # torch's launcher logs "failed (exitcode: N) local_rank: ..." for each failed process: _children_error says it
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        with patch_environment(**env):
            try:
                launch_command(args)
            except ChildFailedError as e:
                stopped = stopped_by_signal(e)
                if stopped is not None:  # a process was signalled (not the launcher): all saved and stopped
                    print(f"trl-flow {command}: {cli_form(stopped_note(stopped), _field_names(command))}",
                          file=sys.stderr, flush=True)
                    raise SystemExit(stopped) from None
                raise _children_error(e, errors) from None  # each process's error once, not the traceback
            except Exception as e:  # the launcher's own rendezvous (before any process starts) failed
                import torch.distributed as dist

                if not isinstance(e, dist.DistError):
                    raise
                raise CLIError(_rendezvous_error(args, config_file, e)) from e
    finally:
        shutil.rmtree(errors, ignore_errors=True)


#: Where the processes of a `--accelerate_config` launch write their one-line errors (a folder; one file a rank).
_ERRORS_ENV = "TRL_FLOW_ERRORS_DIR"


class ChildrenFailed(CLIError):
    """Processes of a launch failed; ``status`` is the exit status of the first that did."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _children_error(error, folder: str) -> ChildrenFailed:
    """The failed processes' own error lines (written to ``folder``), each distinct line once; else their exit
    codes (a crash: their output above says more)."""
    failures = sorted(error.failures.items())
    status = next((f.exitcode for _, f in failures if f.exitcode and f.exitcode > 0), 1)
    lines = {}
    for name in sorted(os.listdir(folder), key=lambda n: int(n) if n.isdigit() else n):
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            lines.setdefault(f.read().strip(), []).append(name)
    if not lines:
        said = ", ".join(f"process {rank} exit code {f.exitcode}" for rank, f in failures)
        return ChildrenFailed(f"{said}; see its output above", status)
    if len(lines) == 1:
        return ChildrenFailed(next(iter(lines)), status)
    return ChildrenFailed("; ".join(f"process {', '.join(ranks)}: {line}" for line, ranks in lines.items()), status)


def _has_accelerator() -> bool:
    import torch

    if torch.cuda.is_available():
        return True
    import accelerate.utils as au

    for name in ("is_xpu_available", "is_npu_available", "is_mlu_available", "is_hpu_available", "is_musa_available"):
        check = getattr(au, name, None)
        try:
            if check is not None and check():
                return True
        except Exception:  # a probe of a device library that is broken here: not that device
            pass
    return False


def cpu_env(command: str) -> dict[str, str]:
    """``ACCELERATE_USE_CPU=true`` for a launch on a machine without GPUs (accelerate would otherwise set up no
    process group: each process would train alone), said in one line; nothing when the variable is set already
    (``ACCELERATE_USE_CPU=false`` keeps accelerate's own choice) or a GPU is found."""
    if os.environ.get("ACCELERATE_USE_CPU") is not None or _has_accelerator():
        return {}
    print(f"trl-flow {command}: no GPU found: the processes run on the CPU (gloo), ACCELERATE_USE_CPU=true",
          file=sys.stderr, flush=True)
    return {"ACCELERATE_USE_CPU": "true"}


def stopped_by_signal(error: BaseException) -> int | None:
    """The exit status (130 / 143) when the launcher failed only because its processes stopped on a SIGINT /
    SIGTERM sent to them (not to the launcher, which would exit by itself): every failure is that exit, or None."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if not isinstance(error, ChildFailedError) or not error.failures:
        return None
    codes = set()
    for failure in error.failures.values():
        code = failure.exitcode
        codes.add(128 - code if code < 0 else code)  # killed by signal n: -n
    if len(codes) == 1 and codes <= {130, 143}:
        return codes.pop()
    return None


def stopped_note(status: int) -> str:
    """The summary of a launch whose processes stopped on a signal: which, and what is on disk."""
    from .engine import checkpoints

    name = "SIGINT" if status == 130 else "SIGTERM"
    out = _STARTED.get("output_dir")
    kept = checkpoints.kept_note(out) if out else "see the output above"
    return f"the processes stopped on {name} (exit status {status}); {kept}"


def _rendezvous_error(args, config_file: str, error: Exception) -> str:
    """What a failed rendezvous of ``accelerate launch`` means and what to check (torchrun times out after
    ``--rdzv_conf timeout=SECONDS``, default 600)."""
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(config_file)
    pick = lambda name: (  # noqa: E731
        getattr(args, name, None) if getattr(args, name, None) is not None else getattr(config, name, None))
    conf = dict(kv.split("=", 1) for kv in (args.rdzv_conf or "").split(",") if "=" in kv)
    machines, rank = pick("num_machines"), pick("machine_rank")
    where = f"{pick('main_process_ip')}:{pick('main_process_port')}"
    return (f"machine_rank {rank} of {machines} machines could not meet the others at the main process {where} within "
            f"{conf.get('timeout', 600)} s ({type(error).__name__}: {str(error).strip().splitlines()[0]}). Check that "
            f"--main_process_ip / --main_process_port are the first machine's (machine_rank 0) and reachable from "
            f"every machine, and that all {machines} machines were started with the same --num_machines and "
            "--num_processes; `--rdzv_conf timeout=SECONDS` sets how long to wait")


#: What a Ctrl-C during start-up can say: the output_dir of the command being run (set once its arguments parse).
_STARTED: dict = {}


def interrupted_note() -> str:
    """For a KeyboardInterrupt that carries no message (raised before training began, e.g. while the model loads):
    what is on disk, never a checkpoint that does not exist."""
    out = _STARTED.get("output_dir")
    if not out:
        return "interrupted before the arguments were read; nothing was written"
    from .engine import checkpoints

    return f"interrupted before training began; {checkpoints.kept_note(out)}"


def run(command: str, argv: list[str]):
    """Run a trainer subcommand: parse, check rewards and prompts, load the pipeline, train, save. Returns the
    trainer (``None`` when the work ran in processes started by ``accelerate launch``). In a process of a
    multi-process launch the process group is destroyed by then (:func:`.engine.distributed.end_processes`)."""
    argv = trl_names(command, argv)  # once, here: the processes of a launch get our names
    script_args, config, launch_args = parse_args(command, argv)
    _STARTED["output_dir"] = config.output_dir
    if script_args.accelerate_config and not os.environ.get(_CHILD_ENV):
        _launch(command, argv, script_args, launch_args)
        return None
    _, trainer_cls = trainer_classes(command)
    threads = resolve_num_threads(script_args.num_threads)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    if not script_args.reward_funcs:
        raise CLIError("reward_funcs: required; e.g. --reward_funcs jpeg_incompressibility (see --help)")
    reward_funcs = [resolve_reward(s) for s in script_args.reward_funcs]
    train, evald = _load_datasets(script_args, config)
    pipe = _load_pipeline(script_args, config)
    trainer = trainer_cls(config, pipe, reward_funcs, train_dataset=train, eval_dataset=evald)
    trainer.train()
    from .engine.distributed import end_processes

    end_processes()  # the command is done; a process group left to exit can abort the process
    return trainer


def precompute(argv: list[str]) -> list[str]:
    """``trl-flow precompute-embeds TRAINER [that trainer's options]``: the prompt embeddings of ``--dataset_name``
    (and ``--eval_dataset``, or the test split when ``eval_steps`` > 0) as that trainer's config would encode them
    (:func:`trl_flow.precompute_prompt_embeds`), saved with ``save_to_disk`` into ``<output_dir>/prompt_embeds/train``
    (and ``.../eval``), on the device a run uses. Returns the folders written."""
    if not argv or argv[0] not in commands():
        raise CLIError(f"{PRECOMPUTE}: the first argument names the trainer whose options follow, one of "
                       f"{', '.join(commands())}; e.g. trl-flow {PRECOMPUTE} grpo --config <recipe> --dataset_name "
                       "prompts.txt --output_dir out")
    command = argv[0]
    script_args, config, _ = parse_args(command, argv[1:])
    out = os.path.join(config.output_dir, "prompt_embeds")
    if os.path.exists(out):
        raise CLIError(f"{out} exists; remove it or pass another --output_dir")
    train, evald = _load_datasets(script_args, config)
    pipe = _load_pipeline(script_args, config)
    if isinstance(pipe, str):  # model_init_kwargs: the trainer would load it with them
        from .models import load_pipeline

        pipe = load_pipeline(pipe, **config.model_init_kwargs)
    import torch

    from .engine.stored_embeds import precompute_prompt_embeds
    from .trainers.trl_compat import apply_model_defaults

    config = apply_model_defaults(config, pipe)  # as the trainer will

    pipe.to("cuda" if torch.cuda.is_available() else "cpu")  # where the trainer encodes (accelerate's default)
    gs_eval = config.eval_guidance_scale if config.eval_guidance_scale is not None else config.guidance_scale
    written = []
    for name, ds, gs in (("train", train, config.guidance_scale), ("eval", evald, gs_eval)):
        if ds is not None:
            path = os.path.join(out, name)
            precompute_prompt_embeds(pipe, ds, guidance_scale=gs, config=config).save_to_disk(path)
            written.append(path)
    print(f"trl-flow {PRECOMPUTE}: wrote {', '.join(written)}; train with --dataset_name {written[0]}"
          + (f" --eval_dataset {written[1]}" if len(written) > 1 else "")
          + " and the same options (the text encoders may then be left out: --model_init_kwargs "
          "'{\"text_encoder\": null, ...}')")
    return written


def cli_form(message: str, names) -> str:
    """An error raised by the Python API, in the form the command line takes: one line, and every
    ``field=value`` (or ``FlowGRPOConfig.field=value``) of a known field ``names`` as ``--field value``, so that
    the fix it names is what the user can type (``pass resume_from_checkpoint=True`` -> ``pass
    --resume_from_checkpoint True``). Keywords of a call (``train(resume_from_checkpoint=...)``) are left alone."""
    names = sorted(set(names), key=len, reverse=True)
    line = " ".join(str(message).split())
    if not names:
        return line
    pattern = re.compile(r"(?<![\w.(,-])(?:\w+Config\.)?(" + "|".join(map(re.escape, names)) + r")=(?!=)")
    return pattern.sub(lambda m: f"--{m.group(1)} ", line)


def _field_names(command: str) -> list[str]:
    import dataclasses

    names = [f.name for f in dataclasses.fields(ScriptArguments)]
    try:
        names += [f.name for f in dataclasses.fields(trainer_classes(command)[0])]
    except CLIError:
        pass
    return names


#: What a run can raise for bad input or a bad environment: reported on one line. Anything else is a bug and keeps
#: its traceback.
_USER_ERRORS = (ValueError, RuntimeError, OSError, ImportError, TypeError, KeyError)


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-flow", allow_abbrev=False,
                                     description="RL post-training of flow-matching diffusers pipelines.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from .trainers.registry import registered_trainers, summary, trainer_aliases

    aliases = trainer_aliases()
    for name, trainer_cls in registered_trainers().items():
        also = [a for a, n in aliases.items() if n == name]
        sub.add_parser(name, help=summary(trainer_cls) + (f" (also: {', '.join(also)})" if also else ""),
                       add_help=False)
    sub.add_parser(REWARD_SERVER, help="serve a reward callable over HTTP for RemoteReward", add_help=False)
    sub.add_parser(PRECOMPUTE, help="save the prompt embeddings of a trainer's datasets: precompute-embeds TRAINER "
                   "[its options]", add_help=False)
    return parser


def _report(command: str, message: str) -> None:
    """Print ``trl-flow <command>: error: <message>``; in a process of a `--accelerate_config` launch, leave it to
    the launching command instead, which prints each distinct error once (:func:`_children_error`)."""
    folder = os.environ.get(_ERRORS_ENV) if os.environ.get(_CHILD_ENV) else None
    if folder and os.path.isdir(folder):
        with open(os.path.join(folder, os.environ.get("RANK", "0")), "w", encoding="utf-8") as f:
            f.write(message)
        return
    print(f"trl-flow {command}: error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``trl-flow``. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in (*commands(), REWARD_SERVER, PRECOMPUTE):
        parser = _top_parser()
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(f"unknown command {argv[0]!r}; choose from "
                         f"{', '.join([*commands(), REWARD_SERVER, PRECOMPUTE])}")
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    try:
        if command == REWARD_SERVER:
            try:
                server = importlib.import_module("trl_flow.rewards.server")
            except ModuleNotFoundError as e:
                if e.name not in ("trl_flow.rewards.server", "trl_flow.rewards"):
                    raise
                raise CLIError("not available in this version of trl_flow") from None
            return server.main(rest) or 0
        if command == PRECOMPUTE:
            precompute(rest)
            return 0
        run(command, rest)
    except CLIError as e:
        _report(command, cli_form(e, _field_names(command)))
        return getattr(e, "status", 2)
    except KeyboardInterrupt as e:  # the trainer's message says what is on disk (a checkpoint, or none)
        said = cli_form(e if str(e) else interrupted_note(), _field_names(command))
        print(f"trl-flow {command}: interrupted; {said}", file=sys.stderr)
        return 130
    except _USER_ERRORS as e:
        if os.environ.get("TRL_FLOW_TRACEBACK"):
            raise
        # a ValueError is a check of the input, which names the field; other types say what failed where
        note = "" if type(e) is ValueError else f" [{type(e).__name__}; TRL_FLOW_TRACEBACK=1 shows the traceback]"
        _report(command, f"{cli_form(e, _field_names(command))}{note}")
        return 2 if isinstance(e, ValueError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
