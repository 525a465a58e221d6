"""`kai-fractions inspect`: what each GPU of a node runs and under which limits, and what the
mirror's replicas do.

- `model`: the report, pure: rows from the pods' annotations (contract package), the state from
  the node agent and the gate's status, used memory from the agent;
- `sources`: the Kubernetes API (pods, node) and the node agent (NodeEnforcer socket or
  Prometheus endpoint), each failure a one-line reason;
- `render`: a table per GPU, JSON or YAML;
- `mirror_state`, `mirror_sources`, `mirror_render`: the same three for `inspect mirror`, the
  mirror's replicas as their Prometheus metrics say.

The demo prints its tables with the same model and renderer.
"""
