# Enable and start on first install, as the DEB does. The unit is skipped (not crash-looping)
# until /etc/nodeproxy/kubeconfig exists. Not in a chroot or container without systemd.
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
    if [ "$1" -eq 1 ]; then
        systemctl enable --now nodeproxy.service >/dev/null 2>&1 || :
    fi
fi
