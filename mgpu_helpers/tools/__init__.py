"""What instructors, authors and planners run, never a learner's notebook: ``authoring`` and ``course``
(`mgpu-course release`: student notebooks from the solutions), ``grading`` (`mgpu-grade`), ``lab``
(`make lab`), ``plan_cli`` with ``plan_sources`` and ``plan_layouts`` (`mgpu-plan`)."""
