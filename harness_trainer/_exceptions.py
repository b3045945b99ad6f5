"""Every error the project raises on purpose, in one tree (httpx's `_exceptions.py` is the model):

    HarnessTrainerError               catch this one to catch them all; its message says what was wrong and what to do
    ├── ConfigError (ValueError)      a setting: a flag, a config field or file (the Python API and the CLI alike)
    │   └── PlacementError            a GPU layout that cannot work
    ├── InputError (ValueError)       something the run was given cannot be used
    │   ├── TaskError                 a task folder or dataset
    │   ├── ModelError                the model named
    │   ├── RewardError               a reward function, or what it returned
    │   ├── EnvironmentContractError  a white-box environment class, its tools or a dataset row
    │   ├── TraceFileError            a trace file line
    │   ├── SFTError                  traces with nothing to train on
    │   ├── JobError                  a job that cannot be built or submitted
    │   └── ViewerError               a folder the viewer cannot show
    ├── SetupError (RuntimeError)     something this machine lacks: an agent program, a sandbox, an image
    │   ├── HarnessError              an agent program missing or misconfigured
    │   └── SandboxError              a sandbox that could not be made or used
    │       └── BuildError            a task's image that could not be built
    ├── ServiceError (RuntimeError)   a server that did not start, answer, or do what it was asked
    │   ├── ProcessError              a supervised server process
    │   ├── EngineError               the vLLM engine
    │   ├── ProxyError                the capture proxy's control routes
    │   │   └── CaptureNotTrainable   its answer: this session's capture is not trainable
    │   ├── ServiceDown               a service gone past the recovery bound
    │   ├── NoEngine                  no engine can take a new session (inside the proxy)
    │   ├── WeightSyncError           a weight-sync step
    │   │   └── EngineUnreachable     ...that could not connect to its engine (gone, or restarting)
    │   └── ModelCallError            a white-box environment's model call
    ├── CaptureError                  a capture that cannot become training data
    │   ├── CaptureContractError      a rollout that breaks the TrainingTrace contract: training stops
    │   ├── NotTrainable              (inside the proxy) the session cannot be exported
    │   └── PolicyRefusal (ValueError) (inside the proxy) a request a training policy cannot allow: HTTP 400
    └── TrainingStopped (RuntimeError) the run cannot go on; its last trained step is kept

The standard bases (ValueError, RuntimeError) stay, so code that caught those still does. Every class is also
importable from the module that raises it, and the public ones from `harness_trainer`. Standard library only:
the capture proxy imports it in its own environment.
"""


class HarnessTrainerError(Exception):
    """Base of every error the project raises on purpose."""


class ConfigError(HarnessTrainerError, ValueError):
    """A config file, field or flag value is wrong; the message names it and says what to do."""


class PlacementError(ConfigError):
    """A GPU layout that cannot work; the message says which flag to change."""


class InputError(HarnessTrainerError, ValueError):
    """Something the run was given (tasks, a model, a function, a file) cannot be used."""


class TaskError(InputError):
    """A task or dataset could not be read; the message names the file and field and what to do."""


class ModelError(InputError):
    """The model named cannot be used; the message says what was wrong and what to do."""


class RewardError(InputError):
    """A reward function could not be found or returned something that is not a reward."""


class EnvironmentContractError(InputError):
    """An environment class, its tools or a dataset row break the contract; the message says what to change."""


class TraceFileError(InputError):
    """A trace file line is not a valid TrainingTrace; names the file and line."""


class SFTError(InputError):
    """The traces cannot be trained on (none found, none with a trained token); the message says what to do."""


class JobError(InputError):
    """The job cannot be built or submitted; the message says what to change. Nothing was sent."""


class ViewerError(InputError):
    """The folder cannot be shown; the message says why and what to give instead."""


class SetupError(HarnessTrainerError, RuntimeError):
    """Something this machine lacks or refused (a program, a daemon, a credential, an image)."""


class HarnessError(SetupError):
    """An agent program is missing or misconfigured; the message says what to do."""


class SandboxError(SetupError):
    """A sandbox could not be created or used; the message names the missing binary, daemon or credential."""


class BuildError(SandboxError):
    """A task's image could not be built or found; the message names the task and its build log."""


class ServiceError(HarnessTrainerError, RuntimeError):
    """A server did not start, answer, or do what it was asked."""


class ProcessError(ServiceError):
    """A supervised server failed to start or stop; the message says what to do."""


class EngineError(ServiceError):
    """The engine could not be started, reached or driven; the message says what to do."""


class ProxyError(ServiceError):
    """The proxy refused or failed a control call; the message carries its answer."""


class CaptureNotTrainable(ProxyError):
    """The session's capture cannot become a TrainingTrace (409 from /sessions/{id}/trace)."""


class ServiceDown(ServiceError):
    """A service did not answer within the recovery bound; the message says which, since when and what to do."""


class NoEngine(ServiceError):
    """No engine can take a new session; the message says which are lost or behind."""


class WeightSyncError(ServiceError):
    """A weight-sync step failed or timed out; the message names the step and the server's answer."""


class EngineUnreachable(WeightSyncError):
    """A weight-sync step could not connect to its engine: gone, or restarting (the trainer waits for it)."""


class ModelCallError(ServiceError):
    """The capture proxy refused or failed a model call: the rollout cannot be scored."""


class CaptureError(HarnessTrainerError):
    """A capture that cannot become training data."""


class CaptureContractError(CaptureError, RuntimeError):
    """A captured rollout breaks the TrainingTrace contract. Fatal: training stops on it."""


class NotTrainable(CaptureError):
    """The session's capture cannot be exported as a TrainingTrace; the message says why."""


class PolicyRefusal(CaptureError, ValueError):
    """The request asks for something a training policy cannot allow; answered as HTTP 400."""


class TrainingStopped(HarnessTrainerError, RuntimeError):
    """The run cannot go on (a failed weight sync, a probe mismatch, a service gone); the message says why."""


__all__ = [name for name, value in dict(globals()).items()
           if isinstance(value, type) and issubclass(value, HarnessTrainerError)]
