"""The numpy-and-yaml core: plans, the planner, re-planning, device specs, caps, the simulator.

Nothing under this folder imports TensorFlow or Horovod (``tests/unit/test_layering.py``
proves it in a Python where both fail to import), so plans can be made, saved, checked and
simulated on any machine.
"""
