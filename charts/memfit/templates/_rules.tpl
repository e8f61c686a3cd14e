{{/*
The alerting and recording rules, as Prometheus rule groups: the PrometheusRule's spec.groups, or the
rules ConfigMap of a plain Prometheus. Trainer series carry finetunejob (namespace/name) and rank; every
expression aggregates by those labels so scrape labels (pod, instance) never split a job.
tests/monitoring runs `promtool test rules` on this output and evaluates each expression on a real
Prometheus.
*/}}
{{- define "memfit.ruleGroups" -}}
{{- $a := .Values.alerts -}}
- name: memfit.recording
  rules:
    - record: finetunejob:memfit_train_tokens_per_second:sum
      expr: sum by (finetunejob) (memfit_train_tokens_per_second)
    - record: finetunejob_rank:memfit_gpu_memory_peak_allocated_bytes:max
      expr: max by (finetunejob, rank) (memfit_gpu_memory_peak_allocated_bytes)
- name: memfit.alerts
  rules:
    - alert: MemfitGPUMemoryNearCapacity
      expr: |
        finetunejob_rank:memfit_gpu_memory_peak_allocated_bytes:max
          / on (finetunejob, rank) max by (finetunejob, rank) (memfit_gpu_capacity_bytes)
          > {{ $a.gpuMemoryRatio }}
      for: 2m
      labels:
        severity: warning
      annotations:
        summary: "{{`{{ $labels.finetunejob }}`}} rank {{`{{ $labels.rank }}`}} peaked at {{`{{ $value | humanizePercentage }}`}} of its GPU's memory"
        description: >-
          The measured peak of tensors on this rank is above {{ mulf $a.gpuMemoryRatio 100 }}% of the GPU's
          memory: a longer batch or allocator fragmentation can run it out of memory (memfit then re-plans with
          a smaller footprint and restarts, from the last checkpoint when the new plan keeps the checkpoint
          layout, else from the model weights). To act before that, lower
          spec.strategy.microBatchSize or set resources.maxGPUs higher, and compare the plan with
          `kubectl get finetunejob -o yaml` (status.plan).
    - alert: MemfitGPUMemoryAbovePrediction
      expr: |
        finetunejob_rank:memfit_gpu_memory_peak_allocated_bytes:max
          / on (finetunejob, rank) max by (finetunejob, rank) (memfit_predicted_peak_allocated_bytes)
          > {{ $a.abovePredictionRatio }}
      for: 5m
      labels:
        severity: warning
      annotations:
        summary: "{{`{{ $labels.finetunejob }}`}} rank {{`{{ $labels.rank }}`}} uses {{`{{ $value | humanize }}`}}x the memory its plan predicted"
        description: >-
          The measured peak is more than {{ $a.abovePredictionRatio }}x memfit's estimate, so the plan's
          headroom is not real and other jobs planned the same way may not fit. Check the job's model
          architecture and sequence length in the spec; if they are right, report the job's status.plan and
          this dashboard to the memfit maintainers (the memory model needs the case).
    - alert: MemfitThroughputCollapsed
      expr: |
        finetunejob:memfit_train_tokens_per_second:sum
          < {{ $a.throughputDropRatio }} * max_over_time(finetunejob:memfit_train_tokens_per_second:sum[{{ $a.throughputWindow }}])
      for: 10m
      labels:
        severity: warning
      annotations:
        summary: "{{`{{ $labels.finetunejob }}`}} trains at {{`{{ $value | humanize }}`}} tokens/s, under {{ mulf $a.throughputDropRatio 100 }}% of its best in {{ $a.throughputWindow }}"
        description: >-
          The job's tokens per second (all ranks) fell below {{ mulf $a.throughputDropRatio 100 }}% of its own
          best over the last {{ $a.throughputWindow }} and stayed there. Usual causes: a slow or throttled node
          (look at the per-rank panel of the memfit job dashboard for the slow rank), contention on the
          network between nodes, or a data volume that became slow. The GPUs are paid for either way.
    - alert: MemfitJobFailed
      expr: max by (finetunejob) (memfit_job_phase{phase="Failed"}) == 1
      for: 1m
      labels:
        severity: critical
      annotations:
        summary: "FineTuneJob {{`{{ $labels.finetunejob }}`}} failed"
        description: >-
          memfit gave up on this job. `kubectl describe finetunejob` shows the reason in its conditions and
          events (with the last trainer pod's termination message). Fix the spec, the data or the inventory and
          create the job again; its GPUs are free meanwhile.
    - alert: MemfitRepeatedOOMReplans
      expr: max by (finetunejob) (memfit_job_replans) >= {{ $a.oomReplans }}
      for: 1m
      labels:
        severity: warning
      annotations:
        summary: "{{`{{ $labels.finetunejob }}`}} ran out of GPU memory and was re-planned {{`{{ $value }}`}} times"
        description: >-
          Each out-of-memory exit made memfit pick a smaller plan and restart (from the last checkpoint, or from
          the model weights when the ZeRO stage or GPU count had to change);
          {{ $a.oomReplans }} or more mean its memory estimate for this job is off and time is lost on restarts.
          Look at the job's measured peak against the prediction (memfit job dashboard), set
          spec.strategy.microBatchSize or a method (lora, qlora) explicitly, and report the case.
    - alert: MemfitNoProgress
      expr: |
        max by (finetunejob) (changes(memfit_train_step[{{ $a.noProgressMinutes }}m])) == 0
          unless on (finetunejob) max by (finetunejob) (memfit_train_progress_ratio) >= 1
      for: 2m
      labels:
        severity: critical
      annotations:
        summary: "{{`{{ $labels.finetunejob }}`}} finished no optimizer step in {{ $a.noProgressMinutes }} minutes"
        description: >-
          The trainer pods are up but no rank completed a step for {{ $a.noProgressMinutes }} minutes while
          holding their GPUs: a hung collective (one rank died or a node lost its network), a stalled data
          volume or a checkpoint that does not finish. `kubectl logs` of the job's pods (label memfit.dev/job)
          shows the last step; deleting a hung pod fails the gang, which memfit restarts (phase Restarting).
{{- end -}}
