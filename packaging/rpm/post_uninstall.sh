# After an upgrade: restart into the new binary. The rules stay in place meanwhile: the new
# process adopts its tables and applies only the difference.
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
    if [ "$1" -ge 1 ]; then
        systemctl try-restart nodeproxy.service >/dev/null 2>&1 || :
    fi
fi
