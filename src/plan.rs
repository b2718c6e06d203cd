//! Memory model and K/V bit-budget planner (work in progress).
