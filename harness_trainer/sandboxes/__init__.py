"""sandboxes: where an agent and then its verifier run. base.py: the Sandbox protocol, an exec's result, a trial's
folders on the host; bubblewrap.py: `local`, a jail per exec in its own network namespace; containers.py: a Docker
container per trial, from images.py's task images, with compose.py's services beside it and spares.py's
containers started ahead; forwarder.py (and forwarder.c): a trial's one road out, to the capture proxy;
remote.py: E2B's cloud and Harbor's environments, driven through harbor_bridge.py in Harbor's own Python;
registry.py: the kinds by name (`--sandbox`, or module:Class), the provider a run's sandboxes come from, and the
checks before the first rollout. Knows nothing of agents or training."""
