"""``compute.slurm``: where on a Slurm cluster a workload's job goes (with ``compute.cluster: slurm``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ...launch.engines.slurm.job import OWN_OPTIONS, SlurmOptions


class SlurmConfig(BaseModel):
    """The job's sbatch options; absent ones are the cluster's defaults."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    partition: str | None = Field(default=None, description="sbatch --partition.", examples=["gpu"])
    account: str | None = Field(default=None, description="sbatch --account.", examples=["my-lab"])
    qos: str | None = Field(default=None, description="sbatch --qos.", examples=["high"])
    constraint: str | None = Field(default=None, description="sbatch --constraint (node features).", examples=["h100"])
    time: str | int | None = Field(
        default=None,
        description="The job's time limit (sbatch --time): minutes, HH:MM:SS or D-HH:MM:SS.",
        examples=["04:00:00", 240],
    )
    signal_before_s: int = Field(
        default=120,
        description=(
            "Seconds before the time limit (or a preemption's grace time) at which Slurm signals the job: the "
            "ranks checkpoint at their next step and the run resubmits as its next attempt."
        ),
        examples=[300],
    )
    sbatch_args: list[str] = Field(
        default_factory=list,
        description=(
            "More sbatch options as they are, e.g. ['--mem=64G', '--exclusive']; not those gpufleet sets "
            f"({', '.join(o for o in OWN_OPTIONS if o.startswith('--'))})."
        ),
        examples=[["--mem=64G", "--exclusive"]],
    )

    @field_validator("time")
    @classmethod
    def _check_time(cls, v: str | int | None) -> str | None:
        if v is None:
            return None
        problems = SlurmOptions(time=str(v)).problems()
        if problems:
            raise ValueError(problems[0])
        return str(v)

    @field_validator("signal_before_s")
    @classmethod
    def _check_signal(cls, v: int) -> int:
        problems = SlurmOptions(signal_before_s=v).problems()
        if problems:
            raise ValueError(problems[0])
        return v

    @field_validator("sbatch_args")
    @classmethod
    def _check_args(cls, v: list[str]) -> list[str]:
        problems = SlurmOptions(sbatch_args=tuple(v)).problems()
        if problems:
            raise ValueError("; ".join(problems))
        return v
