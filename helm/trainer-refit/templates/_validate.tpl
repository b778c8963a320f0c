{{/*
Cross-field checks that values.schema.json cannot express. Each failure names the values to change.
Included by templates/validate.yaml, so every install, upgrade, template and lint runs it.
*/}}
{{- define "trainer-refit.validate" -}}
{{- $v := .Values }}
{{- $t := $v.trainer }}
{{- if not (or $t.enabled $v.vllm.enabled) }}
{{- fail "trainer-refit: nothing to deploy: enable trainer.enabled, vllm.enabled or both" }}
{{- end }}
{{- if and $t.enabled (not $v.model.path) }}
{{- fail "trainer-refit: model.path is required: set it to the HF checkpoint directory inside the pods (e.g. /checkpoints/models/base)" }}
{{- end }}
{{- if and $v.vllm.enabled (not (or $v.vllm.modelPath $v.model.path)) }}
{{- fail "trainer-refit: a model path is required for the vLLM receivers: set model.path (or vllm.modelPath) to the HF checkpoint directory inside the pods" }}
{{- end }}
{{- if $t.enabled }}
{{- $tp := $t.layout.tp | int }}
{{- $pp := $t.layout.pp | int }}
{{- $dp := $t.layout.dp | int }}
{{- $nodes := $t.nodes | int }}
{{- $perNode := $t.gpusPerNode | int }}
{{- $ranks := mul $tp $pp $dp }}
{{- $gpus := mul $nodes $perNode }}
{{- if ne $ranks $gpus }}
{{- fail (printf "trainer-refit: trainer.layout tp*pp*dp = %d*%d*%d = %d ranks, but trainer.nodes*trainer.gpusPerNode = %d*%d = %d GPUs; each GPU runs exactly one rank, so both products must be equal" $tp $pp $dp $ranks $nodes $perNode $gpus) }}
{{- end }}
{{- if ne 0 (mod $perNode $tp) }}
{{- fail (printf "trainer-refit: trainer.layout.tp = %d does not divide trainer.gpusPerNode = %d; a tensor-parallel group must fit inside one node" $tp $perNode) }}
{{- end }}
{{- if and (gt $nodes 1) $v.checkpoints.enabled (not $v.checkpoints.existingClaim) (not (has "ReadWriteMany" $v.checkpoints.accessModes)) }}
{{- fail (printf "trainer-refit: trainer.nodes = %d pods mount the checkpoint volume from several nodes: add ReadWriteMany to checkpoints.accessModes or set checkpoints.existingClaim" $nodes) }}
{{- end }}
{{- end }}
{{- if and $v.sidecar.enabled (not $t.enabled) }}
{{- fail "trainer-refit: sidecar.enabled needs trainer.enabled: the sidecar runs in the rank-0 trainer pod. For receivers of a sidecar elsewhere set sidecar.enabled=false and vllm.sidecarAddress=HOST:PORT" }}
{{- end }}
{{- if and $v.vllm.enabled (not $v.sidecar.enabled) (not $v.vllm.sidecarAddress) }}
{{- fail "trainer-refit: vllm.sidecarAddress (HOST:PORT) is required when sidecar.enabled is false: the receivers need a refit sidecar to pull weights from" }}
{{- end }}
{{- if and $v.auth.enabled $v.vllm.enabled (not $v.sidecar.enabled) (not $v.auth.existingSecret) }}
{{- fail "trainer-refit: auth.existingSecret is required for receivers of another release's sidecar (vllm.sidecarAddress): copy that release's <fullname>-auth Secret (its receiver key) into this namespace and name it here, or set auth.enabled=false for a sidecar run with --insecure" }}
{{- end }}
{{- if $v.vllm.enabled }}
{{- $r := $v.vllm }}
{{- if and $r.readinessGate.versionInstalled (not $r.autoRefit) }}
{{- fail "trainer-refit: vllm.readinessGate.versionInstalled needs vllm.autoRefit: only a replica that follows the sidecar by itself reports the version it serves on /trainer_refit/ready. Set vllm.autoRefit=true, or vllm.readinessGate.versionInstalled=false for replicas a driver refits" }}
{{- end }}
{{- if and $r.autoRefit (ne $r.workerExtensionCls "inference_ext.RefitWorkerExtension") }}
{{- fail (printf "trainer-refit: vllm.autoRefit drives the workers through inference_ext.RefitWorkerExtension, but vllm.workerExtensionCls = %s: set it back, or vllm.autoRefit=false" $r.workerExtensionCls) }}
{{- end }}
{{- $options := include "trainer-refit.autoRefitOptionsGiven" . | fromJson }}
{{- if and $options (not $r.autoRefit) }}
{{- fail (printf "trainer-refit: vllm.autoRefitOptions (%s) are set but vllm.autoRefit is false: set vllm.autoRefit=true, or vllm.autoRefitOptions={} for replicas a driver refits" (keys $options | sortAlpha | join ", ")) }}
{{- end }}
{{- range $source, $env := dict "env" $v.env "vllm.env" $r.env }}
{{- range $env }}
{{- if eq .name "VLLM_PLUGINS" }}
{{- fail (printf "trainer-refit: %s sets VLLM_PLUGINS, which the chart sets to the vLLM plugins the receivers need (trainer_refit): list further plugins in vllm.extraPlugins instead" $source) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if and $v.auth.tls.mutual (not $v.auth.tls.secretName) }}
{{- fail "trainer-refit: auth.tls.mutual needs auth.tls.secretName (a Secret with tls.crt, tls.key and ca.crt)" }}
{{- end }}
{{- if gt ($v.nixl.tcpPortRange.start | int) ($v.nixl.tcpPortRange.end | int) }}
{{- fail (printf "trainer-refit: nixl.tcpPortRange.start = %d is after nixl.tcpPortRange.end = %d" ($v.nixl.tcpPortRange.start | int) ($v.nixl.tcpPortRange.end | int)) }}
{{- end }}
{{- end }}
