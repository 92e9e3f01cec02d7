"""The budget planner: candidates (what each unit's options free and cost), the pure solvers on
numbers (knapsack), and the graph adapter that applies a solution (planner)."""
