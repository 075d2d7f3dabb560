"""Reference implementations a judge compares learners' answers against (imported only inside
``Check.judge``; masked by the grading sandbox). Nothing here is for a notebook."""
