"""`kai-fractions inspect`: what each GPU of a node runs and under which limits, and what the
mirror's replicas do.

- `model`: the report, pure, assembled from `container_rows` (a row per container: the
  pods' annotations through the contract package, the state from the node agent and its events
  on the pod, used memory from the agent), `pod_status` (the pod's own status: the gate, why it
  is stuck) and `report_types` (the report's shape, which `render` and the demo read);
  `agent_events` (its events on a pod: the newest per container), `heartbeat` (its last sign
  of life);
- `sources`: the Kubernetes API (pods, node, events) and the node agent (NodeEnforcer socket or
  Prometheus endpoint, read by `agent_metrics`), each failure a one-line reason;
- `render`: a table per GPU, JSON or YAML;
- `mirror_state`, `mirror_sources`, `mirror_render`: the same three for `inspect mirror`, the
  mirror's replicas as their Prometheus metrics say.

The demo prints its tables with the same model and renderer.
"""
