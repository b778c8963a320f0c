{{/*
Names, labels and small building blocks shared by the templates.
*/}}

{{- define "trainer-refit.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Prefix of every resource name. Truncated to 36 characters: the longest StatefulSet name adds
"-trainer-worker" (51), and the controller-revision-hash label of its pods appends "-" and up to 10
more characters, which must stay within the 63 of a label value.
*/}}
{{- define "trainer-refit.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 36 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 36 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 36 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "trainer-refit.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "trainer-refit.selectorLabels" -}}
app.kubernetes.io/name: {{ include "trainer-refit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels that identify the chart release but select nothing. */}}
{{- define "trainer-refit.metaLabels" -}}
helm.sh/chart: {{ include "trainer-refit.chart" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: trainer-refit
{{- end }}

{{- define "trainer-refit.labels" -}}
{{ include "trainer-refit.selectorLabels" . }}
{{ include "trainer-refit.metaLabels" . }}
{{- end }}

{{/*
Selector labels of trainer pods. Called with (dict "root" $ "role" "head"|"worker"|""):
role "head" is the rank-0 pod (node rank 0, gRPC server, sidecar); "" selects all ranks.
*/}}
{{- define "trainer-refit.trainerSelectorLabels" -}}
{{ include "trainer-refit.selectorLabels" .root }}
app.kubernetes.io/component: trainer
{{- if .role }}
trainer-refit/role: {{ .role }}
{{- end }}
{{- end }}

{{- define "trainer-refit.trainerLabels" -}}
{{ include "trainer-refit.trainerSelectorLabels" . }}
{{ include "trainer-refit.metaLabels" .root }}
{{- end }}

{{- define "trainer-refit.vllmSelectorLabels" -}}
{{ include "trainer-refit.selectorLabels" . }}
app.kubernetes.io/component: vllm
{{- end }}

{{- define "trainer-refit.vllmLabels" -}}
{{ include "trainer-refit.vllmSelectorLabels" . }}
{{ include "trainer-refit.metaLabels" . }}
{{- end }}

{{/* Resource names. */}}
{{- define "trainer-refit.configName" -}}{{ include "trainer-refit.fullname" . }}-config{{- end }}
{{- define "trainer-refit.headName" -}}{{ include "trainer-refit.fullname" . }}-trainer-head{{- end }}
{{- define "trainer-refit.workerName" -}}{{ include "trainer-refit.fullname" . }}-trainer-worker{{- end }}
{{- define "trainer-refit.headlessName" -}}{{ include "trainer-refit.fullname" . }}-trainer-headless{{- end }}
{{- define "trainer-refit.groupName" -}}{{ include "trainer-refit.fullname" . }}-trainer-group{{- end }}
{{- define "trainer-refit.trainerServiceName" -}}{{ include "trainer-refit.fullname" . }}-trainer{{- end }}
{{- define "trainer-refit.sidecarServiceName" -}}{{ include "trainer-refit.fullname" . }}-sidecar{{- end }}
{{- define "trainer-refit.vllmName" -}}{{ include "trainer-refit.fullname" . }}-vllm{{- end }}
{{- define "trainer-refit.checkpointClaimName" -}}
{{- .Values.checkpoints.existingClaim | default (printf "%s-checkpoints" (include "trainer-refit.fullname" .)) }}
{{- end }}

{{- define "trainer-refit.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "trainer-refit.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Fully qualified DNS name of a Service of this release: (dict "root" $ "name" "svc"). */}}
{{- define "trainer-refit.serviceFQDN" -}}
{{- printf "%s.%s.svc.%s" .name .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{/*
torch.distributed master address (rank 0). StatefulSets: pod 0 of the head StatefulSet through the
headless Service, which publishes not-ready addresses (rank 0 turns ready only after every rank
joined). LeaderWorkerSet: the leader address that the LWS webhook injects into every container.
*/}}
{{- define "trainer-refit.masterAddr" -}}
{{- if .Values.trainer.leaderWorkerSet.enabled -}}
$(LWS_LEADER_ADDRESS)
{{- else -}}
{{ include "trainer-refit.headName" . }}-0.{{ include "trainer-refit.serviceFQDN" (dict "root" . "name" (include "trainer-refit.headlessName" .)) }}
{{- end }}
{{- end }}

{{/* Address the receivers pull from: vllm.sidecarAddress, else this release's sidecar Service. */}}
{{- define "trainer-refit.sidecarAddress" -}}
{{- if .Values.vllm.sidecarAddress -}}
{{ .Values.vllm.sidecarAddress }}
{{- else -}}
{{ include "trainer-refit.serviceFQDN" (dict "root" . "name" (include "trainer-refit.sidecarServiceName" .)) }}:{{ .Values.sidecar.port | int }}
{{- end }}
{{- end }}

{{/* Image reference: (dict "root" $ "override" .Values.<component>.image). */}}
{{- define "trainer-refit.image" -}}
{{- $img := merge (deepCopy (.override | default dict)) .root.Values.image -}}
{{ $img.repository }}:{{ $img.tag | default .root.Chart.AppVersion }}
{{- end }}

{{- define "trainer-refit.imagePullPolicy" -}}
{{- (.override | default dict).pullPolicy | default .root.Values.image.pullPolicy }}
{{- end }}

{{/*
Container resources with the chart's extended resources added to limits and requests:
(dict "resources" .Values.x.resources "extra" (dict "nvidia.com/gpu" 8)).
*/}}
{{- define "trainer-refit.resources" -}}
{{- $res := deepCopy (.resources | default dict) }}
{{- if .extra }}
{{- $limits := $res.limits | default dict }}
{{- $requests := $res.requests | default dict }}
{{- range $name, $count := .extra }}
{{- $_ := set $limits $name ($count | int) }}
{{- $_ := set $requests $name ($count | int) }}
{{- end }}
{{- $_ := set $res "limits" $limits }}
{{- $_ := set $res "requests" $requests }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* GPU (and RDMA) requests of a container: (dict "root" $ "gpus" N). */}}
{{- define "trainer-refit.acceleratorResources" -}}
{{- $extra := dict .root.Values.gpu.resourceName (.gpus | int) }}
{{- if .root.Values.rdma.enabled }}
{{- $_ := set $extra .root.Values.rdma.resourceName (.root.Values.rdma.resourceCount | int) }}
{{- end }}
{{- toYaml $extra }}
{{- end }}

{{/* Container securityContext; IPC_LOCK is added for RDMA when (dict "root" $ "rdma" true). */}}
{{- define "trainer-refit.securityContext" -}}
{{- $sc := deepCopy (.root.Values.securityContext | default dict) }}
{{- if and .rdma .root.Values.rdma.enabled .root.Values.rdma.ipcLock }}
{{- $caps := $sc.capabilities | default dict }}
{{- $add := append (without ($caps.add | default list) "IPC_LOCK") "IPC_LOCK" }}
{{- $_ := set $caps "add" $add }}
{{- $_ := set $sc "capabilities" $caps }}
{{- end }}
{{- if $sc }}
securityContext:
  {{- toYaml $sc | nindent 2 }}
{{- end }}
{{- end }}

{{/* envFrom of every container: the release ConfigMap and the credentials Secret. */}}
{{- define "trainer-refit.envFrom" -}}
envFrom:
  - configMapRef:
      name: {{ include "trainer-refit.configName" . }}
{{- with .Values.credentials.existingSecret }}
  - secretRef:
      name: {{ . }}
{{- end }}
{{- end }}

{{/* NCCL/UCX environment when RDMA is on, as EnvVar list items (possibly none). */}}
{{- define "trainer-refit.rdmaEnv" -}}
{{- $r := .Values.rdma }}
{{- if $r.enabled }}
{{- $vars := dict }}
{{- with $r.ncclIbHca }}{{ $_ := set $vars "NCCL_IB_HCA" . }}{{ end }}
{{- with $r.ncclSocketIfname }}{{ $_ := set $vars "NCCL_SOCKET_IFNAME" . }}{{ end }}
{{- if not (kindIs "invalid" $r.ncclIbGidIndex) }}{{ $_ := set $vars "NCCL_IB_GID_INDEX" ($r.ncclIbGidIndex | int | toString) }}{{ end }}
{{- with $r.ucxTls }}{{ $_ := set $vars "UCX_TLS" . }}{{ end }}
{{- with $r.ucxNetDevices }}{{ $_ := set $vars "UCX_NET_DEVICES" . }}{{ end }}
{{- range $name, $value := $r.extraEnv }}{{ $_ := set $vars $name (toString $value) }}{{ end }}
{{- range $name := keys $vars | sortAlpha }}
- name: {{ $name }}
  value: {{ get $vars $name | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* A probe's timing fields, one "key: value" per line: (dict "timing" .Values.x.probes.startup). */}}
{{- define "trainer-refit.probeTiming" -}}
{{- $lines := list }}
{{- range $key := list "initialDelaySeconds" "periodSeconds" "timeoutSeconds" "successThreshold" "failureThreshold" }}
{{- if hasKey $.timing $key }}
{{- $lines = append $lines (printf "%s: %d" $key (get $.timing $key | int)) }}
{{- end }}
{{- end }}
{{- join "\n" $lines }}
{{- end }}

{{/*
Native gRPC probes (startup, readiness, liveness) on a grpc.health.v1 service:
(dict "port" 50051 "probes" .Values.x.probes "tls" <TLS secret name or "">). The kubelet's gRPC
probe speaks plaintext only, so with TLS the probes check that the port accepts connections.
*/}}
{{- define "trainer-refit.grpcProbes" -}}
{{- $port := .port | int }}
{{- $service := .probes.service | default "" }}
{{- range $i, $kind := list "startup" "readiness" "liveness" }}
{{- if $i }}{{ "\n" }}{{ end -}}
{{ $kind }}Probe:
  {{- if $.tls }}
  tcpSocket:
    port: {{ $port }}
  {{- else }}
  grpc:
    port: {{ $port }}
    {{- if $service }}
    service: {{ $service | quote }}
    {{- end }}
  {{- end }}
  {{- include "trainer-refit.probeTiming" (dict "timing" (get $.probes $kind)) | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Scheduling fields of a pod: (dict "root" $ "component" .Values.trainer "antiAffinity" labels-or-nil).
A component's own nodeSelector / tolerations / affinity replace the global ones when not empty.
With antiAffinity, a required podAntiAffinity on kubernetes.io/hostname is added unless the affinity
already has a podAntiAffinity.
*/}}
{{- define "trainer-refit.scheduling" -}}
{{- $root := .root }}
{{- $c := .component }}
{{- with ($c.nodeSelector | default $root.Values.nodeSelector) }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with ($c.tolerations | default $root.Values.tolerations) }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $affinity := deepCopy ($c.affinity | default $root.Values.affinity | default dict) }}
{{- if and .antiAffinity (not (hasKey $affinity "podAntiAffinity")) }}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" .antiAffinity) }}
{{- $_ := set $affinity "podAntiAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (list $term)) }}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $c.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $c.schedulerName }}
schedulerName: {{ . }}
{{- end }}
{{- end }}

{{/* Pod-level fields shared by every pod of the release. */}}
{{- define "trainer-refit.podCommon" -}}
serviceAccountName: {{ include "trainer-refit.serviceAccountName" . }}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Volume of the checkpoint claim, when mounted. */}}
{{- define "trainer-refit.checkpointVolume" -}}
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ include "trainer-refit.checkpointClaimName" . }}
{{- end }}

{{/* /dev/shm as a memory emptyDir: (dict "sizeLimit" "64Gi"). */}}
{{- define "trainer-refit.shmVolume" -}}
- name: dshm
  emptyDir:
    medium: Memory
    {{- with .sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}

{{/* Checksum of the ConfigMap, so that a changed layout rolls the pods on upgrade. */}}
{{- define "trainer-refit.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end }}

{{/* -- Authentication, TLS and NIXL wiring (README "Security", docs/security.md) -- */}}

{{/* Secret of the role tokens: auth.existingSecret, else the one the chart generates. */}}
{{- define "trainer-refit.authSecretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "trainer-refit.fullname" .)) }}
{{- end }}

{{- define "trainer-refit.tokenDir" -}}/var/run/secrets/trainer-refit/tokens{{- end }}
{{- define "trainer-refit.tlsDir" -}}/var/run/secrets/trainer-refit/tls{{- end }}

{{/*
Volumes of a container's secrets: (dict "root" $ "name" "trainer-tokens" "roles" (list ...)).
Only the tokens of `roles` are projected into the volume: each container sees the tokens it uses.
*/}}
{{- define "trainer-refit.secretVolumes" -}}
{{- if .root.Values.auth.enabled }}
- name: {{ .name }}
  secret:
    secretName: {{ include "trainer-refit.authSecretName" .root }}
    items:
      {{- range .roles }}
      - key: {{ . }}
        path: {{ . }}
      {{- end }}
{{- end }}
{{- with .root.Values.auth.tls.secretName }}
- name: {{ $.name }}-tls
  secret:
    secretName: {{ . }}
{{- end }}
{{- end }}

{{/* Read-only mounts of those volumes: (dict "root" $ "name" "trainer-tokens"). */}}
{{- define "trainer-refit.secretMounts" -}}
{{- if .root.Values.auth.enabled }}
- name: {{ .name }}
  mountPath: {{ include "trainer-refit.tokenDir" .root }}
  readOnly: true
{{- end }}
{{- if .root.Values.auth.tls.secretName }}
- name: {{ .name }}-tls
  mountPath: {{ include "trainer-refit.tlsDir" .root }}
  readOnly: true
{{- end }}
{{- end }}

{{/*
trainer-svc's authentication flags, as args list items. Every rank parses them (rank 0 serves
gRPC, every rank publishes to the sidecar): the orchestrator's token guards the API, the trainer's
authenticates the ranks at the sidecar.
*/}}
{{- define "trainer-refit.trainerAuthArgs" -}}
{{- $v := .Values }}
{{- $tokens := include "trainer-refit.tokenDir" . }}
{{- $tls := include "trainer-refit.tlsDir" . }}
{{- if $v.auth.enabled }}
- --auth-token-dir={{ $tokens }}
{{- if $v.sidecar.enabled }}
- --sidecar-token-file={{ $tokens }}/trainer
{{- end }}
{{- else }}
- --insecure
{{- end }}
{{- if $v.auth.tls.secretName }}
- --tls-cert={{ $tls }}/tls.crt
- --tls-key={{ $tls }}/tls.key
{{- if $v.auth.tls.mutual }}
- --tls-client-ca={{ $tls }}/ca.crt
{{- end }}
{{- if $v.sidecar.enabled }}
- --sidecar-tls-ca={{ $tls }}/ca.crt
{{- if $v.auth.tls.mutual }}
- --sidecar-tls-cert={{ $tls }}/tls.crt
- --sidecar-tls-key={{ $tls }}/tls.key
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* refit-sidecar's authentication flags, as args list items. */}}
{{- define "trainer-refit.sidecarAuthArgs" -}}
{{- $tls := include "trainer-refit.tlsDir" . }}
{{- if .Values.auth.enabled }}
- --auth-token-dir={{ include "trainer-refit.tokenDir" . }}
{{- else }}
- --insecure
{{- end }}
{{- if .Values.auth.tls.secretName }}
- --tls-cert={{ $tls }}/tls.crt
- --tls-key={{ $tls }}/tls.key
{{- if .Values.auth.tls.mutual }}
- --tls-client-ca={{ $tls }}/ca.crt
{{- end }}
{{- end }}
{{- end }}

{{/* A receiver's authentication at the sidecar, as inference_ext RefitOptions fields (a dict). */}}
{{- define "trainer-refit.receiverAuthOptions" -}}
{{- $tls := include "trainer-refit.tlsDir" . }}
{{- $options := dict }}
{{- if .Values.auth.enabled }}
{{- $_ := set $options "token_file" (printf "%s/receiver" (include "trainer-refit.tokenDir" .)) }}
{{- else }}
{{- $_ := set $options "insecure" true }}
{{- end }}
{{- if .Values.auth.tls.secretName }}
{{- $_ := set $options "tls_ca" (printf "%s/ca.crt" $tls) }}
{{- if .Values.auth.tls.mutual }}
{{- $_ := set $options "tls_cert" (printf "%s/tls.crt" $tls) }}
{{- $_ := set $options "tls_key" (printf "%s/tls.key" $tls) }}
{{- end }}
{{- end }}
{{- toYaml $options }}
{{- end }}

{{/* The vllm.autoRefitOptions given (null means not given), as a JSON object. */}}
{{- define "trainer-refit.autoRefitOptionsGiven" -}}
{{- $given := dict }}
{{- range $key, $value := .Values.vllm.autoRefitOptions | default dict }}
{{- if not (kindIs "invalid" $value) }}
{{- $_ := set $given $key $value }}
{{- end }}
{{- end }}
{{- toJson $given }}
{{- end }}

{{/*
A receiver's --additional-config, as JSON: {"refit": {"sidecar": ..., auth options, "auto": ...}}.
"auto" is vllm.autoRefit, or with vllm.autoRefitOptions the object of the options given, named as
inference_ext.auto_config.AutoRefitConfig names its fields.
*/}}
{{- define "trainer-refit.receiverAdditionalConfig" -}}
{{- $auto := .Values.vllm.autoRefit }}
{{- $fields := dict "policy" "policy" "pauseMode" "pause_mode" "maxStaleness" "max_staleness" "pollIntervalSeconds" "poll_interval_s" "retryIntervalSeconds" "retry_interval_s" }}
{{- $given := include "trainer-refit.autoRefitOptionsGiven" . | fromJson }}
{{- if and $auto $given }}
{{- $auto = dict }}
{{- range $key, $value := $given }}
{{- $_ := set $auto (get $fields $key) $value }}
{{- end }}
{{- end }}
{{- $refit := merge (dict "sidecar" "$(SIDECAR_ADDRESS)" "auto" $auto) (include "trainer-refit.receiverAuthOptions" . | fromYaml) }}
{{- dict "refit" $refit | toJson }}
{{- end }}

{{/*
VLLM_PLUGINS of the receivers: the package's plugins (the trainer_refit weight-transfer backend and
auto-refit endpoints share the name) and vllm.extraPlugins. vLLM loads only the plugins it names, in
every plugin group.
*/}}
{{- define "trainer-refit.vllmPlugins" -}}
{{- prepend (.Values.vllm.extraPlugins | default list) "trainer_refit" | uniq | join "," }}
{{- end }}

{{/*
trainer-svc's NIXL and path flags, as args list items. The ranks' NIXL endpoints listen on the pod
IP (and the RDMA ports of rdma.ucxNetDevices); with RDMA but no device list UCX chooses among every
device, so no interface is singled out.
*/}}
{{- define "trainer-refit.trainerPlacementArgs" -}}
{{- $v := .Values }}
{{- $devices := list }}
{{- if $v.rdma.enabled }}
{{- range (splitList "," $v.rdma.ucxNetDevices) }}{{ with trim . }}{{ $devices = append $devices . }}{{ end }}{{ end }}
{{- end }}
{{- if and $v.rdma.enabled (not $devices) }}
- --nixl-host=0.0.0.0
{{- else }}
- --nixl-host=$(POD_IP)
{{- range $devices }}
- --nixl-net-device={{ . }}
{{- end }}
{{- end }}
{{- $roots := $v.trainer.pathRoots }}
{{- if and (not $roots) $v.checkpoints.enabled }}{{ $roots = list $v.checkpoints.mountPath }}{{ end }}
{{- range $roots }}
- --path-root={{ . }}
{{- end }}
{{- end }}

{{/* Environment of a NIXL container (trainer, vLLM): UCX's TCP listening ports, as EnvVar items. */}}
{{- define "trainer-refit.nixlEnv" -}}
{{- $range := .Values.nixl.tcpPortRange }}
- name: UCX_TCP_PORT_RANGE
  value: {{ printf "%d-%d" ($range.start | int) ($range.end | int) | quote }}
{{- end }}
