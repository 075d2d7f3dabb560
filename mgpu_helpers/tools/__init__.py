"""What instructors and authors run, never a learner's notebook: ``authoring`` and ``course``
(`mgpu-course release`: student notebooks from the solutions), ``grading`` (`mgpu-grade`), ``lab``
(`make lab`)."""
