"""`kai-fractions inspect`: what each GPU of a node runs and under which limits.

- `model`: the report, pure: rows from the pods' annotations (contract package), the state from
  the node agent and the gate's status, used memory from the agent;
- `sources`: the Kubernetes API (pods, node) and the node agent (NodeEnforcer socket or
  Prometheus endpoint), each failure a one-line reason;
- `render`: a table per GPU, JSON or YAML.

The demo prints its tables with the same model and renderer.
"""
