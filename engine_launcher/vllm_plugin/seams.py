"""Every vLLM symbol the plugin patches, overrides, calls or reads, checked in vLLM's source
without importing it.

A new vLLM release can move or reshape any of them; `check(root)` reads the `.py` files
under `root` (the directory that contains the `vllm` package: an installed one, or the
`.py` files unzipped from a wheel that cannot run here) and returns what is missing or has
changed shape, one line each. `python -m engine_launcher.vllm_plugin.seams ROOT` prints
them. tests/launcher/test_vllm_plugin_seams.py runs it against the installed vLLM, and
docs/VLLM_PLUGIN.md says which releases it was run against.

It checks shapes (a class, a method and its leading parameters, an attribute the code
assigns, an enum's members, a call inside a method), not behaviour: the real-engine tests
do that.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SCHEDULER = "vllm/v1/core/sched/scheduler.py"
ENGINE = "vllm/v1/engine/__init__.py"
REQUEST = "vllm/v1/request.py"
CONNECTORS = "vllm/distributed/kv_transfer/kv_connector/v1"


@dataclass(frozen=True)
class Seam:
    """`kind`: class, function, constant (module level); method (with leading parameters
    after self in `args`), attribute (assigned on self, a class field, a method or a
    property), member (an enum member, `args` its value), call (inside method `name` of
    `owner`, a call to `self.<args[0]>` whose first argument is named `args[1]`)."""

    path: str
    owner: str | None
    name: str
    kind: str
    args: tuple[str, ...] = ()
    why: str = ""


def _method(path: str, owner: str, name: str, *args: str, why: str = "") -> Seam:
    return Seam(path, owner, name, "method", args, why)


def _attrs(path: str, owner: str, names: str, why: str) -> list[Seam]:
    return [Seam(path, owner, n, "attribute", why=why) for n in names.split()]


SEAMS: tuple[Seam, ...] = (
    # scheduler.py: the scheduler classes
    Seam(SCHEDULER, None, "Scheduler", "class", why="ThresholdScheduler's base"),
    Seam("vllm/v1/core/sched/async_scheduler.py", None, "AsyncScheduler", "class", why="ThresholdAsyncScheduler"),
    _method(SCHEDULER, "Scheduler", "_ec_transfer_pending", "request", "num_computed_tokens", why="admission hook"),
    Seam(
        SCHEDULER,
        "Scheduler",
        "schedule",
        "call",
        ("_ec_transfer_pending", "request"),
        why="the WAITING loop asks the hook before it allocates",
    ),
    _method(SCHEDULER, "Scheduler", "schedule", why="rejections finished after it returns"),
    _method(SCHEDULER, "Scheduler", "add_request", "request", why="arrival check"),
    _method(SCHEDULER, "Scheduler", "finish_requests", "request_ids", "finished_status", why="ends a rejection"),
    _method(SCHEDULER, "Scheduler", "update_from_output", "scheduler_output", "model_runner_output", why="reports it"),
    *_attrs(SCHEDULER, "Scheduler", "requests kv_cache_manager connector block_size vllm_config", "read state"),
    _method("vllm/v1/core/kv_cache_manager.py", "KVCacheManager", "get_computed_blocks", "request", why="arrival"),
    Seam("vllm/v1/core/sched/output.py", None, "SchedulerOutput", "class"),
    Seam("vllm/v1/outputs.py", None, "ModelRunnerOutput", "class"),
    # engine outputs and the finish reason
    Seam(ENGINE, None, "FINISH_REASON_STRINGS", "constant", why="extended with cache_threshold"),
    Seam(ENGINE, "FinishReason", "REPETITION", "member", ("4",), why="value 5 must be free"),
    *_attrs(
        ENGINE,
        "EngineCoreOutput",
        "request_id new_token_ids finish_reason events trace_headers kv_transfer_params",
        "a rejection's output",
    ),
    *_attrs(ENGINE, "EngineCoreOutputs", "outputs", "a rejection's output"),
    Seam(REQUEST, "RequestStatus", "PREEMPTED", "member", why="FINISHED_CACHE_THRESHOLD sorts after it"),
    Seam(REQUEST, None, "_FINISHED_REASON_MAP", "constant", why="status -> finish reason"),
    *_attrs(
        REQUEST,
        "Request",
        "request_id num_computed_tokens num_tokens num_output_tokens sampling_params kv_transfer_params "
        "client_index get_finished_reason take_events trace_headers skip_reading_prefix_cache block_hashes",
        "read by the scheduler and the CPU-tier lookup",
    ),
    # API server: request validation, the rejected stream
    _method("vllm/entrypoints/openai/completion/protocol.py", "CompletionRequest", "to_sampling_params"),
    _method("vllm/entrypoints/openai/chat_completion/protocol.py", "ChatCompletionRequest", "to_sampling_params"),
    _method("vllm/entrypoints/openai/responses/protocol.py", "ResponsesRequest", "to_sampling_params"),
    *_attrs("vllm/entrypoints/openai/completion/protocol.py", "CompletionRequest", "vllm_xargs", "threshold"),
    *_attrs("vllm/entrypoints/openai/chat_completion/protocol.py", "ChatCompletionRequest", "vllm_xargs", "threshold"),
    *_attrs("vllm/entrypoints/openai/responses/protocol.py", "ResponsesRequest", "vllm_xargs", "threshold"),
    *_attrs("vllm/entrypoints/anthropic/protocol.py", "AnthropicMessagesRequest", "vllm_xargs", "threshold"),
    _method(
        "vllm/entrypoints/anthropic/serving.py",
        "AnthropicServingMessages",
        "to_chat_completion_request",
        "anthropic_request",
        why="carries a top-level threshold into the chat request",
    ),
    Seam("vllm/exceptions.py", None, "VLLMValidationError", "class", why="400 for a bad threshold"),
    _method("vllm/v1/engine/async_llm.py", "AsyncLLM", "generate", why="keeps a rejected stream's finish"),
    *_attrs(
        "vllm/outputs.py",
        "RequestOutput",
        "request_id outputs prompt_token_ids num_cached_tokens kv_transfer_params",
        "a rejected stream's last output, fixed up",
    ),
    *_attrs("vllm/outputs.py", "CompletionOutput", "text finish_reason", "a rejected stream's last output"),
    # KV connectors read by the arrival check
    Seam(f"{CONNECTORS}/multi_connector.py", None, "MultiConnector", "class"),
    *_attrs(f"{CONNECTORS}/multi_connector.py", "MultiConnector", "sub_connectors", "its children"),
    Seam(f"{CONNECTORS}/nixl/connector.py", None, "NixlBaseConnector", "class"),
    _method(
        f"{CONNECTORS}/nixl/connector.py",
        "NixlBaseConnector",
        "get_num_new_matched_tokens",
        "request",
        "num_computed_tokens",
    ),
    Seam(f"{CONNECTORS}/offloading_connector.py", None, "OffloadingConnector", "class"),
    *_attrs(f"{CONNECTORS}/offloading/scheduler.py", "OffloadingConnectorScheduler", "_req_status manager", "CPU tier"),
    Seam("vllm/v1/kv_offload/base.py", None, "LookupResult", "class"),
    Seam("vllm/v1/kv_offload/base.py", None, "make_offload_key", "function"),
    _method("vllm/v1/kv_offload/cpu/manager.py", "CPUOffloadingManager", "lookup", "key"),
    # NIXL progress-thread delay
    Seam("vllm/distributed/nixl_utils.py", None, "_load_nixl_attr", "function", why="lazy NIXL patch"),
)


@cache
def _tree(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def _top(tree: ast.Module, name: str) -> ast.stmt | None:
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node
    return None


def _functions(cls: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _has_attribute(cls: ast.ClassDef, name: str) -> bool:
    if name in _functions(cls):
        return True
    for node in ast.walk(cls):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return True
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for t in targets:
            if (
                isinstance(t, ast.Attribute)
                and t.attr == name
                and isinstance(t.value, ast.Name)
                and t.value.id == "self"
            ):
                return True
            if isinstance(t, ast.Name) and t.id == name and node in cls.body:
                return True
    return False


def _calls(fn: ast.AST, callee: str, first_arg: str) -> bool:
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == callee
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == first_arg
        ):
            return True
    return False


def problem(root: Path, seam: Seam) -> str | None:
    """What is wrong with `seam` under `root`, or None."""
    where = f"{seam.path}: {seam.owner + '.' if seam.owner else ''}{seam.name}"
    tree = _tree(root / seam.path)
    if tree is None:
        return f"{seam.path}: missing or unreadable"
    if seam.owner is None:
        node = _top(tree, seam.name)
        if (
            node is None
            or (seam.kind == "class" and not isinstance(node, ast.ClassDef))
            or (seam.kind == "function" and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))
        ):
            return f"{where}: no such {seam.kind}"
        return None
    cls = _top(tree, seam.owner)
    if not isinstance(cls, ast.ClassDef):
        return f"{seam.path}: no class {seam.owner}"
    if seam.kind == "attribute":
        return None if _has_attribute(cls, seam.name) else f"{where}: no such attribute"
    if seam.kind == "member":
        for node in cls.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == seam.name for t in node.targets
            ):
                value = ast.unparse(node.value)
                if seam.args and value != seam.args[0]:
                    return f"{where}: value {value}, expected {seam.args[0]}"
                return None
        return f"{where}: no such member"
    fn = _functions(cls).get(seam.name)
    if fn is None:
        return f"{where}: no such method"
    if seam.kind == "call":
        callee, first_arg = seam.args
        return None if _calls(fn, callee, first_arg) else f"{where}: no call self.{callee}({first_arg}, ...)"
    params = [a.arg for a in fn.args.args][1:]
    if params[: len(seam.args)] != list(seam.args):
        return f"{where}: parameters {params}, expected {list(seam.args)} first"
    return None


def check(root: Path) -> list[str]:
    """Every problem of every seam under `root` (empty: all present, in the expected shape)."""
    return [p for seam in SEAMS if (p := problem(root, seam)) is not None]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m engine_launcher.vllm_plugin.seams DIR  (DIR contains the vllm package)")
        return 2
    problems = check(Path(argv[0]))
    for p in problems:
        print(p)
    print(f"{len(SEAMS)} seams checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
