"""The Ray actors that keep the cluster running: the controller (owns the supervisors), the supervisor
(one worker process from spawn to exit), the restart policy, the records an actor survives its own
death with, the calls that tell the router of every state change, each supervisor's status row pushed to the
controller and kept there, and the controller's loopback status endpoint that `dsv4-cluster status` asks (no Ray
needed). Process-group liveness is `orchestrator/processes.py`."""
