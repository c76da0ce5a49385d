"""The built-in `python` tool: the model's code runs in a fresh bubblewrap sandbox per call.

    [rollout.env.options]
    tools = ["python"]                  # the built-in name; import paths work beside it
    [rollout.env.options.python]
    max_output_chars = 1000             # the observation is cut to this many characters
    [rollout.env.options.python.sandbox.limits]
    wall_s = 5

The observation is what the code printed: stdout, then stderr (when not empty), then a status
line when it did not exit 0 (`[exit 1]`, `[timeout]`, `[killed]`, `[output_limit]`,
`[syntax_error]`). Every call is a new sandbox (no state is kept between calls or episodes),
awaited on the event loop, so executions overlap the generation of other episodes; the pool of
one environment factory bounds how many run at once (`sandbox.workers`). Tool responses are
loss-masked like every observation.
"""

from pydantic import BaseModel, ConfigDict, Field

from verst.rollout.sandbox import SandboxConfig, SandboxPool


class PythonToolConfig(BaseModel):
    """Options of the built-in `python` tool (`[rollout.env.options.python]`)."""

    model_config = ConfigDict(extra="forbid")

    max_output_chars: int = Field(
        1000, ge=1, description="The observation (stdout, stderr, status) is cut to this many characters."
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig, description="The sandbox each call runs in."
    )


class PythonTool:
    """Run Python code in a sandbox and return what it printed.

    Args:
        code: the program; its stdout and stderr come back.
    """

    __name__ = "python"

    def __init__(self, config: PythonToolConfig | None = None) -> None:
        self.config = config or PythonToolConfig()
        """The tool's options."""
        self.pool = SandboxPool(self.config.sandbox)
        """Bounds the calls that run at once, across the episodes of one run."""
        self.pool.check()  # no bwrap here: one line saying what to install, before any work

    async def __call__(self, code: str) -> str:
        res = await self.pool.run(code)
        text = res.stdout
        if res.stderr:
            text += ("" if not text or text.endswith("\n") else "\n") + res.stderr
        if not res.ok:
            status = f"exit {res.exit_code}" if res.status.value == "error" else res.status.value
            text += ("" if not text or text.endswith("\n") else "\n") + f"[{status}]"
        cap = self.config.max_output_chars
        return text if len(text) <= cap else text[:cap] + "…"
